"""Launching a test's ranks: forked from a forkserver under a timeout, so that a rank stuck in a
collective is killed and the test fails saying so, never waits for CI's own limit.

The forkserver (one per pytest process, started by the first launch) imports torch.distributed,
DTensor, FSDP2, the pipelining runtime and remat once; each rank is a fork of it, so a rank
starts without importing them again. Spawned ranks paid those imports on every rank of every
launch: about 5 s of CPU a rank, 20 s for a 4-rank launch, as much as some jobs' training. The
ranks still start clean: the server itself never plans, trains or joins a process group."""
from __future__ import annotations

import multiprocessing.forkserver
import os
import tempfile
import time

import pytest
import torch
import torch.multiprocessing as mp

# What every rank of the suite's distributed tests imports (an import that fails here is left
# to the rank, which then reports it).
PRELOAD = ["torch.distributed", "torch.distributed.tensor", "torch.distributed.fsdp",
           "torch.distributed.pipelining", "torch.distributed.device_mesh", "remat",
           "remat.fx_passes.eager.apply", "remat.fx_passes.measuring.allocator",
           "examples.llama_3d", "tests.allocator"]


def spawn_ranks(fn, args: tuple, nprocs: int, seconds: float) -> None:
    """Run `fn(rank, *args)` on `nprocs` processes; fail the test after `seconds`."""
    multiprocessing.forkserver.set_forkserver_preload(PRELOAD)  # before the server starts
    context = mp.start_processes(fn, args=args, nprocs=nprocs, join=False,
                                 start_method="forkserver")
    deadline = time.monotonic() + seconds
    while not context.join(timeout=5):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"the ranks did not finish within {seconds:.0f} s")


def rank_results(fn, args: tuple, nprocs: int, seconds: float) -> list:
    """Run `fn(rank, init, *args, results)` on `nprocs` processes (`init`: a file rendezvous for
    `init_process_group`; each rank `torch.save`s what it found to ``f"{results}.{rank}"``) and
    return those, rank by rank."""
    with tempfile.TemporaryDirectory() as tmp:
        results = os.path.join(tmp, "result")
        spawn_ranks(fn, (f"file://{tmp}/rendezvous", *args, results), nprocs, seconds)
        return [torch.load(f"{results}.{rank}") for rank in range(nprocs)]
