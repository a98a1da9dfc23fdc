"""The allocator counted on every thread (`remat.fx_passes.measuring.every_thread`): a block
that another thread frees, as gloo's worker frees a send buffer or a collective's output, is
gone from the reading at the measuring thread's next event, where the profiler-paired reading
counts it live to the end; a block from before the step that the step frees is told apart.

Run in a fork of tests/ranks.py's server: the allocator's flag is process-wide and would change
what other tests' readings see."""
from __future__ import annotations

import threading

import pytest
import torch

from remat.fx_passes.measuring.allocator import AllocatorTrace, cpu_memory_events, paired
from remat.fx_passes.measuring.every_thread import (addresses, every_thread_reading,
                                                   track_every_thread)
from tests.ranks import rank_results

KIB = 1024


def _step(kept: list, buffer: list) -> None:
    """256 KiB handed to another thread, which drops the last reference; then 128 KiB here,
    freed here; the 1 MiB block the last step left, freed here; and a 64 KiB buffer the
    caller holds, replaced by one of the same size."""
    sent = [torch.empty(64 * KIB)]  # float32: 256 KiB
    worker = threading.Thread(target=sent.pop)
    worker.start()
    worker.join()
    here = torch.empty(32 * KIB)
    del here
    kept.pop()
    buffer[0] = torch.empty(16 * KIB)


def _readings(rank: int, init: str, results: str) -> None:
    track_every_thread()
    kept, buffer = [torch.empty(256 * KIB)], [torch.empty(16 * KIB)]
    reading = every_thread_reading(lambda: _step(kept, buffer), held=addresses(buffer))
    kept = [torch.empty(256 * KIB)]
    with cpu_memory_events() as events:
        _step(kept, buffer)
    trace = AllocatorTrace(tuple(paired(events)))
    torch.save({"every": vars(reading), "paired": (trace.peak, trace.end)}, f"{results}.{rank}")


def test_every_thread_sees_another_threads_free():
    out = rank_results(_readings, (), 1, seconds=120)[0]
    # Every thread: 256 KiB at most; 1 MiB from before freed, the held buffer not counted
    # as left by the last step.
    assert out["every"] == {"peak": 256 * KIB, "end": -1024 * KIB, "from_before": 1024 * KIB}
    # The profiler's thread alone: the other thread's free unseen, the block live to the end,
    # and the replaced buffer's free (a block from before) unseen too.
    assert out["paired"] == (384 * KIB, 320 * KIB)


def test_a_reading_without_the_count_is_refused():
    from remat.fx_passes.measuring.every_thread import _flag

    if _flag().value:
        pytest.skip("this process already counts every thread")
    with pytest.raises(RuntimeError, match="track_every_thread"):
        every_thread_reading(lambda: None)
