"""Launching a test's ranks: `torch.multiprocessing.spawn` under a timeout, so that a rank stuck
in a collective is killed and the test fails saying so, never waits for CI's own limit."""
from __future__ import annotations

import os
import tempfile
import time

import pytest
import torch
import torch.multiprocessing as mp


def spawn_ranks(fn, args: tuple, nprocs: int, seconds: float) -> None:
    """Run `fn(rank, *args)` on `nprocs` processes; fail the test after `seconds`."""
    context = mp.spawn(fn, args=args, nprocs=nprocs, join=False)
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
