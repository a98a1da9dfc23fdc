"""Measure a planned step from inside its compiled graphs: the allocator's peak, live bytes
and FLOPs, in one run that changes nothing it measures.

`measure_step(module, inputs)` runs one forward and backward of a `PlannedModule` (built with
`compile=False`):
- the allocator's peak (`remat.fx_passes.measuring.allocator.step_peak`: torch.profiler's memory events
  on the CPU, ``max_memory_allocated`` on CUDA) above what was allocated before the step,
  kernel scratch included: comparable with `simulate(problem, schedule).peak`;
- a `MemoryTracker` and a `FlopCounter` entered inside the compiled forward and backward
  graphs, so their numbers describe the graphs that ran (and the call counts prove that they
  did). The tracker names the op at its peak; it sees storages that ops return, not kernel
  scratch. The FLOP counter never decomposes an op (``FlopCounterMode`` does, and the pieces
  really allocate: a Llama step read +5.7 % under it), so the allocator sees the step itself.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any, Sequence

import torch

from remat.fx_passes.measuring.allocator import step_peak
from remat.fx_passes.measuring.flops import FlopCounter
from remat.fx_passes.measuring.memory_tracker import MemoryTracker
from remat.fx_passes.compiled.planned import GraphCalls, PlannedModule

__all__ = ["StepMeasurement", "measure_step", "time_step"]


@dataclass(frozen=True)
class StepMeasurement:
    peak: int  # the allocator's peak above the step's start, kernel scratch included
    tracked_peak: int  # most live bytes of storages made inside the graphs, at any op
    peak_op: str  # the op at the tracker's peak
    forward_flops: int
    backward_flops: int  # recomputations included
    loss: float
    forward_calls: int
    backward_calls: int

    @property
    def flops(self) -> int:
        return self.forward_flops + self.backward_flops

    def to_dict(self) -> dict:
        return {**asdict(self), "flops": self.flops}


def measure_step(module: PlannedModule, inputs: Sequence[Any]) -> StepMeasurement:
    """One forward and backward of `module` on `inputs`, measured. The gradients accumulate
    into the parameters as in any step. The device measured is the first parameter's (or the
    first input's)."""
    tracker = MemoryTracker()
    counters = {phase: FlopCounter() for phase in ("forward", "backward")}
    with module.instrument(lambda phase: tracker, lambda phase: counters[phase]) as calls:
        peak, loss = step_peak(lambda: module(*inputs),
                               lambda out, seed: out.backward(seed), _device(module, inputs))
        value = float(loss.detach())
        del loss
    _check_ran(calls)
    return StepMeasurement(
        peak=peak, tracked_peak=tracker.peak, peak_op=tracker.peak_op,
        forward_flops=counters["forward"].total, backward_flops=counters["backward"].total,
        loss=value, forward_calls=calls.forward, backward_calls=calls.backward)


def _device(module: PlannedModule, inputs: Sequence[Any]) -> torch.device:
    for value in (*module.parameters(), *inputs):
        if isinstance(value, torch.Tensor):
            return value.device
    return torch.device("cpu")


def time_step(step, *, repeat: int = 5, warmup: int = 1) -> float:
    """The fastest of `repeat` runs of `step()` (a full forward and backward), in seconds:
    on a shared CPU the minimum is the least disturbed by other work."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return min(times)


def _check_ran(calls: GraphCalls) -> None:
    if calls.forward < 1 or calls.backward < 1:
        raise RuntimeError(f"the compiled graphs did not run (forward {calls.forward}, backward "
                           f"{calls.backward} calls): dynamo ran something else; the "
                           "measurement would describe eager PyTorch")
