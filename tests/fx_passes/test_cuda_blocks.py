"""CUDA storages are counted as the caching allocator holds them: in 512-byte blocks.

The CUDA caching allocator rounds every request up to a multiple of 512 bytes and
``max_memory_allocated`` counts the rounded blocks, so a plan captured on a GPU that counted the
requested bytes read a few hundred bytes per small tensor under the allocator (GPT-2 medium on
an H200: `benchmarks/gpu_check.py`). Fake CUDA tensors carry the device without a GPU, so the
rule is checked here on the CPU; on a GPU, gpu_check compares the plan with the allocator.
"""
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from remat.fx_passes.measuring.storage import (CUDA_BLOCK, allocated_bytes, held_bytes,
                                               storage_bytes)


def test_cuda_storages_round_up_to_the_allocator_block():
    with FakeTensorMode():
        scalar = torch.zeros((), dtype=torch.bfloat16, device="cuda")
        odd = torch.empty(250, dtype=torch.float32, device="cuda")
        whole = torch.empty(1024, dtype=torch.float16, device="cuda")
        empty = torch.empty(0, device="cuda")
        on_cpu = torch.empty(250, dtype=torch.float32)
    assert storage_bytes(scalar) == CUDA_BLOCK == 512
    assert storage_bytes(odd) == 1024  # 1000 bytes asked
    assert storage_bytes(whole) == 2048  # already whole blocks
    assert storage_bytes(empty) == 0  # the allocator hands out no block for nothing
    assert storage_bytes(on_cpu) == 1000  # the CPU allocator is read as asked


def test_only_cuda_rounds():
    assert allocated_bytes(3, torch.device("cuda", 0)) == 512
    assert allocated_bytes(513, torch.device("cuda")) == 1024
    assert allocated_bytes(3, torch.device("cpu")) == 3
    assert allocated_bytes(3, torch.device("meta")) == 3
    assert held_bytes(torch.empty(3, dtype=torch.uint8).untyped_storage()) == 3
