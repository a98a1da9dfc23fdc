"""The CPU allocator's view of a step: torch.profiler memory events, summed in time order
(`torch.profiler.profile(profile_memory=True)`). It sees every allocation, kernel scratch included.

Unlike `remat.fx_passes.measuring.allocator`, which keeps only frees whose allocation it saw (a guard
against the profiler's stale sizes, for one step's graphs), this counts every free:
with pairing, the FSDP2 test's rank 0 ended its step 329,472 bytes above its gradient shards
(frees of blocks allocated before the window were dropped); counted, it ends at them exactly."""
from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

from remat.fx_passes.measuring.storage import distinct_storage_bytes as storage_bytes


def allocator_peak(fn) -> tuple[int, int]:
    """(peak, end): the most bytes allocated at once while `fn()` runs, and the bytes still
    allocated when it returns, both counted from what was allocated before it."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    live = peak = 0
    for e in events:
        live += e.nbytes()
        peak = max(peak, live)
    return peak, live


__all__ = ["allocator_peak", "storage_bytes", "torch"]
