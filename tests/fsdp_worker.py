"""One rank of an FSDP2 training step on the CPU (gloo), measured by the allocator; spawned by
tests/fx_passes/test_sharded_memory.py. Not a test module itself."""
from __future__ import annotations

import json
import os
import sys
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]


def llama_model(layers: int = 2, batch: int = 2):
    """A small Llama (examples/llama.py) and its inputs, the same on every call."""
    sys.path.insert(0, str(ROOT / "examples"))
    from llama import LLAMA_TINY, llama

    return llama(replace(LLAMA_TINY, layers=layers, seq=64), batch=batch)


def run(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        from torch.distributed.fsdp import fully_shard

        from tests.allocator import allocator_peak, storage_bytes

        model, (tokens, targets) = llama_model()
        layers = list(model.layers)
        for layer in layers:
            fully_shard(layer)
        fully_shard(model)
        # One block ahead in both directions (what FSDP2 overlaps on a GPU by default; on a
        # CPU nothing runs asynchronously, so the prefetch is made explicit).
        for a, b in zip(layers, layers[1:]):
            a.set_modules_to_forward_prefetch([b])
            b.set_modules_to_backward_prefetch([a])
        model(tokens, targets).backward()  # lazy initialization outside the measurement
        model.zero_grad(set_to_none=True)
        shards = storage_bytes(p.to_local() for p in model.parameters())
        # Three measured steps, the least kept: in some runs rank 0's allocator saw up to
        # ~200 KB more at its peak (and at its end) than in others, the model and the step
        # unchanged (gloo's own buffers, by timing); the step's own memory is the least.
        readings = []
        for _ in range(3):
            model.zero_grad(set_to_none=True)
            readings.append(allocator_peak(lambda: model(tokens, targets).backward()))
        peak, end = min(r[0] for r in readings), min(r[1] for r in readings)
        grads = storage_bytes(p.grad.to_local() for p in model.parameters())
        Path(out, f"rank{rank}.json").write_text(json.dumps(
            {"shards": shards, "peak": peak, "end": end, "grads": grads}))
    finally:
        dist.destroy_process_group()
