"""The allocator's own peak on the CPU: torch.profiler's memory events, summed in time order.

It sees every allocation the step makes (kernel scratch included), which a dispatch-mode
tracker cannot: it is the judge of a predicted peak (TORCH-NOTES.md, "Measuring").
"""
from __future__ import annotations

import gc
from typing import Any, Callable

import torch

__all__ = ["allocator_peak"]


def allocator_peak(fn: Callable[[], Any]) -> tuple[int, Any]:
    """(most bytes live at once among the allocations made while `fn()` ran, above what was
    live when it started; `fn()`'s result)."""
    # Garbage of earlier work freed inside the window would read as negative bytes.
    gc.collect()
    activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities, profile_memory=True) as prof:
        result = fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak, result
