"""A step's memory on the CPU as the allocator counts it on every thread, not only the thread
that the profiler records.

torch.profiler records the memory events of the thread that runs it (and of threads that
inherit its state, such as autograd's). A collective library's worker thread is not one of
them: gloo's thread drops the last reference to a collective's work, and with it to tensors
the work kept (send buffers, an all-reduce's clone), freeing them unseen. A reading that pairs
events (`allocator.paired`) then counts such a block live to the end of the step, by timing:
some readings catch the free, some do not.

c10's CPU allocator keeps its own count of live bytes, for every thread, once its flag
``caffe2_report_cpu_memory_usage`` is set (`track_every_thread`); every memory event the
profiler records then carries that count (``total_allocated``). `every_thread_reading` reads
it at each allocation and free of the measuring thread: a free on another thread shows at the
measuring thread's next event, which is when that thread could next use the memory. What it
cannot see: a block that another thread allocates and frees between two events of the
measuring thread (gloo allocates none of the tensors it sends or receives into).

Blocks allocated before `track_every_thread` are outside the count (their frees are ignored):
set it before the job allocates anything, first thing in a rank.
"""
from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch

__all__ = ["StepReading", "addresses", "every_thread_reading", "track_every_thread"]

_FLAG = "FLAGS_caffe2_report_cpu_memory_usage"


def _flag() -> ctypes.c_bool:
    library = os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so")
    try:
        return ctypes.c_bool.in_dll(ctypes.CDLL(library), _FLAG)
    except (OSError, ValueError) as e:
        raise RuntimeError(f"cannot count the CPU allocator on every thread: {library} has no "
                           f"{_FLAG} ({e}); read the step with "
                           "remat.fx_passes.measuring.allocator.allocator_peak instead, which "
                           "sees the profiled thread only") from e


def track_every_thread() -> None:
    """Make c10's CPU allocator count every thread's allocations and frees from now on. Call
    it before the job allocates what a reading should see freed."""
    _flag().value = True


@dataclass(frozen=True)
class StepReading:
    """One step, counted on every thread.

    peak: the most live bytes above the step's start. end: live bytes when it returned, above
    its start. from_before: bytes of blocks live at the start, other than those of the
    caller's `held` tensors, that the step freed on the measuring thread: what the last step
    left for this one to replace, held between steps on top of what the caller counts as
    held. The step's whole peak is then held + from_before + peak."""

    peak: int
    end: int
    from_before: int


def addresses(tensors: Iterable[torch.Tensor]) -> frozenset[int]:
    """The allocator's addresses of `tensors`' storages: what `every_thread_reading` takes
    as held, without holding the tensors (one that the step replaces must be free to go)."""
    return frozenset(t.untyped_storage().data_ptr() for t in tensors)


def every_thread_reading(step: Callable[[], Any], held: frozenset[int] = frozenset()
                         ) -> StepReading:
    """Run ``step()`` once under the profiler and read the allocator's every-thread count.
    `held`: the `addresses` of what the caller counts as held when the step starts (a
    receive buffer that the step replaces is freed in it, and is not something the last
    step left)."""
    from torch.profiler import ProfilerActivity, profile

    if not _flag().value:
        raise RuntimeError("the CPU allocator does not count every thread: call "
                           "track_every_thread() before the job allocates (first thing in "
                           "each rank)")
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = []  # (time, address, signed bytes, live bytes after it on every thread)
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        stack.extend(event.children)
        fields = event.extra_fields
        if type(fields).__name__ == "_ExtraFields_Allocation" and fields.device.type == "cpu":
            events.append((event.start_time_ns, fields.ptr, fields.alloc_size,
                           fields.total_allocated))
    if not events:
        return StepReading(0, 0, 0)
    events.sort(key=lambda e: e[0])
    start = events[0][3] - events[0][2]
    allocated, from_before = set(), 0
    for _, ptr, size, _ in events:
        if size > 0:
            allocated.add(ptr)
        elif ptr not in allocated and ptr not in held:
            from_before -= size
    return StepReading(peak=max(0, max(e[3] for e in events) - start),
                       end=events[-1][3] - start, from_before=from_before)
