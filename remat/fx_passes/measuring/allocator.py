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

__all__ = ["AllocatorTrace", "allocator_peak", "cpu_memory_events", "paired", "peak_and_result",
           "step_peak"]


@contextlib.contextmanager
def cpu_memory_events() -> Iterator[list[tuple[int, int]]]:
    """Record the CPU allocator's events while the block runs; the yielded list is filled, on
    exit, with the (address, signed bytes) of every allocation (+) and free (-) in the order
    they ran. `paired` turns one or more such lists into the sizes that count.

    Only frees of blocks allocated inside the measurement count. The profiler remembers the size of
    every block allocated while any profiler runs; a block freed while none runs
    keeps its entry, and a new block at the same address, freed inside a later profile, is
    then reported with the stale size: a free that never was (a planned ViT step read 18 %
    low). Pairing each free with an allocation seen here by address drops those, and the
    frees of blocks that were held before (the baseline)."""
    from torch.profiler import ProfilerActivity, profile

    events: list[int] = []
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        yield events
    allocations = []
    stack = list(reversed(prof.profiler.kineto_results.experimental_event_tree()))
    while stack:  # pre-order: an op's allocations in the order it made them
        event = stack.pop()
        stack.extend(reversed(event.children))
        fields = event.extra_fields
        if type(fields).__name__ == "_ExtraFields_Allocation" and fields.device.type == "cpu":
            allocations.append((event.start_time_ns, fields.ptr, fields.alloc_size))
    allocations.sort(key=lambda a: a[0])  # stable: ties keep the order they were found in
    events.extend((ptr, size) for _, ptr, size in allocations)


def paired(events: list[tuple[int, int]]) -> list[int]:
    """Signed sizes of `events` (cpu_memory_events'), each free taking the size its block was
    allocated with here; frees of blocks allocated elsewhere are dropped."""
    live: dict[int, int] = {}
    sizes = []
    for ptr, size in events:
        if size > 0:
            live[ptr] = size
            sizes.append(size)
        elif ptr in live:
            sizes.append(-live.pop(ptr))
    return sizes


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


def _cuda_window(fn: Callable[[], Any], device: torch.device) -> tuple[Any, int]:
    """(fn's result, the CUDA allocator's peak while it ran above what was allocated before)."""
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    result = fn()
    torch.cuda.synchronize(device)
    return result, torch.cuda.max_memory_allocated(device) - base


def _checked(device: torch.device | str) -> torch.device:
    device = torch.device(device)
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"the allocator is measured on the CPU or CUDA, not {device}")
    return device


def allocator_peak(step: Callable[[], Any], device: torch.device | str = "cpu") -> int:
    """The allocator's peak while ``step()`` runs, above what was allocated when it began."""
    return peak_and_result(step, device)[0]


def peak_and_result(step: Callable[[], Any], device: torch.device | str = "cpu"
                    ) -> tuple[int, Any]:
    """(`allocator_peak` of ``step()``, what ``step()`` returned)."""
    device = _checked(device)
    if device.type == "cuda":
        result, peak = _cuda_window(step, device)
        return peak, result
    with cpu_memory_events() as events:
        result = step()
    return AllocatorTrace(tuple(paired(events))).peak, result


def step_peak(forward: Callable[[], Any], backward: Callable[[Any, Any], Any],
              device: torch.device | str = "cpu") -> tuple[int, Any]:
    """(the allocator's peak of a training step, the forward's result). Runs
    ``out = forward()``, then makes the seed ``ones_like`` of the loss and runs
    ``backward(out, seed)``, as ``loss.backward()`` makes its seed: the seed is part of the
    step, held through the backward. The peak is above what was allocated before the
    forward."""
    device = _checked(device)
    if device.type == "cuda":
        base = torch.cuda.memory_allocated(device)
        out, forward_peak = _cuda_window(forward, device)
        held = torch.cuda.memory_allocated(device) - base
        _, backward_peak = _cuda_window(lambda: backward(out, _seed(out)), device)
        return max(forward_peak, held + backward_peak), out
    with cpu_memory_events() as forward_events:
        out = forward()
    with cpu_memory_events() as backward_events:
        seed = _seed(out)
        backward(out, seed)
        del seed
    return AllocatorTrace(tuple(paired(forward_events + backward_events))).peak, out


def _seed(out: Any) -> torch.Tensor:
    loss = out if isinstance(out, torch.Tensor) else getattr(out, "loss", None)
    if not isinstance(loss, torch.Tensor):
        raise TypeError(f"the forward returned {type(out).__name__}, not a loss tensor")
    return torch.ones_like(loss)
