"""The allocator's own view of memory: what raises out-of-memory, kernel scratch included.

A dispatch-mode tracker (`memory_tracker`) sees the storages that ops return; it cannot see
what a kernel allocates and frees while it runs (oneDNN's convolution-backward scratchpad on
the CPU, cuDNN/cuBLAS workspaces on CUDA, the temporaries inside dropout's backward). The
allocator sees both:
- on the CPU, torch.profiler's memory events (``profile_memory=True``), one per allocation and
  free, in the order the allocator served them; `AllocatorTrace` keeps their running sum;
- on CUDA, ``torch.cuda.memory_allocated`` and ``max_memory_allocated``.

`allocator_peak(step, device)` runs ``step()`` once and returns the most bytes allocated at
any moment above what was allocated when it began (parameters, inputs, optimizer state and
anything else held before the step are the baseline, not counted). `step_peak(forward,
backward, device)` does the same for a training step, leaving out the gradient that seeds the
backward (``loss.backward()``'s ones): like the batch, it is an input of the step's graphs,
which the simulator counts in the static term, not in the activations.
"""
from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

log = logging.getLogger(__name__)

__all__ = ["AllocatorTrace", "allocator_peak", "cpu_memory_events", "step_peak"]


@contextlib.contextmanager
def cpu_memory_events() -> Iterator[list[int]]:
    """Record the CPU allocator's events while the block runs; the yielded list is filled, on
    exit, with the signed bytes of every allocation (+) and free (-), in allocation order."""
    from torch.profiler import ProfilerActivity, profile

    events: list[int] = []
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True,
                 record_shapes=False, with_stack=False) as prof:
        yield events
    raw = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"
           and e.device_type() == torch.autograd.DeviceType.CPU]
    # The events are listed in the order they were recorded; sort stably by time in case
    # another thread's queue was appended after this one's.
    raw.sort(key=lambda e: e.start_ns())
    events.extend(int(e.nbytes()) for e in raw)


@dataclass(frozen=True)
class AllocatorTrace:
    """Signed allocation sizes in order; `peak` is the highest running sum above the start."""

    events: tuple[int, ...]

    @property
    def peak(self) -> int:
        live = peak = 0
        for nbytes in self.events:
            live += nbytes
            peak = max(peak, live)
        return peak

    @property
    def end(self) -> int:
        return sum(self.events)


def allocator_peak(step: Callable[[], Any], device: torch.device | str = "cpu") -> int:
    """The allocator's peak while ``step()`` runs, above what was allocated when it began."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        result = step()
        torch.cuda.synchronize(device)
        del result
        return torch.cuda.max_memory_allocated(device) - base
    if device.type != "cpu":
        raise ValueError(f"allocator_peak measures the CPU or CUDA allocator, not {device}")
    with cpu_memory_events() as events:
        result = step()
        del result
    return AllocatorTrace(tuple(events)).peak


def step_peak(forward: Callable[[], Any], backward: Callable[[Any, Any], Any],
              device: torch.device | str = "cpu") -> tuple[int, Any]:
    """(the allocator's peak of a training step, the forward's result). Runs
    ``out = forward()``, makes the seed ``ones_like`` of the loss outside the measurement, then
    ``backward(out, seed)``. The peak is above what was allocated before the forward."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        out = forward()
        torch.cuda.synchronize(device)
        forward_peak = torch.cuda.max_memory_allocated(device)
        before_seed = torch.cuda.memory_allocated(device)
        seed = _seed(out)
        seed_bytes = torch.cuda.memory_allocated(device) - before_seed  # rounded by the allocator
        torch.cuda.reset_peak_memory_stats(device)
        backward(out, seed)
        torch.cuda.synchronize(device)
        backward_peak = torch.cuda.max_memory_allocated(device) - seed_bytes
        return max(forward_peak, backward_peak) - base, out
    if device.type != "cpu":
        raise ValueError(f"step_peak measures the CPU or CUDA allocator, not {device}")
    with cpu_memory_events() as forward_events:
        out = forward()
    seed = _seed(out)
    with cpu_memory_events() as backward_events:
        backward(out, seed)
        del seed
    events = AllocatorTrace(tuple(forward_events) + tuple(backward_events))
    return events.peak, out


def _seed(out: Any) -> torch.Tensor:
    loss = out if isinstance(out, torch.Tensor) else getattr(out, "loss", None)
    if not isinstance(loss, torch.Tensor):
        raise TypeError(f"the forward returned {type(out).__name__}, not a loss tensor")
    return torch.ones_like(loss)
