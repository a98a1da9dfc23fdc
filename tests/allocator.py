"""The CPU allocator's view of a step: torch.profiler memory events, summed in time order
(TORCH-NOTES.md). It sees every allocation, kernel scratch included."""
from __future__ import annotations

import torch

from remat.fx_passes.allocator import AllocatorTrace, cpu_memory_events, paired


def allocator_peak(fn) -> tuple[int, int]:
    """(peak, end): the most bytes allocated at once while `fn()` runs, and the bytes still
    allocated when it returns, both counted from what was allocated before it."""
    with cpu_memory_events() as events:
        fn()
    trace = AllocatorTrace(tuple(paired(events)))
    return trace.peak, trace.end


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages of `tensors`."""
    seen = {}
    for t in tensors:
        if t is not None:
            s = t.untyped_storage()
            seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


__all__ = ["allocator_peak", "storage_bytes", "torch"]
