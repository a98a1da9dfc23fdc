"""Measure a planned step from inside its compiled graphs: live bytes and FLOPs.

`measure_step(module, inputs)` runs one forward and backward of a `PlannedModule` (built with
`compile=False`) with a `MemoryTracker` and FLOP counters entered inside the compiled forward
and backward graphs, so the numbers describe the graphs that ran (and the call counts prove
that they did), comparable with `simulate(problem, schedule).peak` and the problem's FLOPs.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any, Sequence


from remat.fx_passes.flops import register_cpu_attention
from remat.fx_passes.memory_tracker import MemoryTracker
from remat.fx_passes.planned import GraphCalls, PlannedModule

__all__ = ["StepMeasurement", "flop_instrument", "measure_step", "time_step"]


@dataclass(frozen=True)
class StepMeasurement:
    peak: int  # most live bytes of storages made inside the graphs, at any op
    peak_op: str
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


def flop_instrument(counters: dict[str, Any]):
    """An instrument for `PlannedModule.instrument` that counts FLOPs per phase into
    `counters[phase]` (FlopCounterMode objects). Inside an fx graph the public context manager
    trips on its module-tracker hooks (TORCH-NOTES.md), so it enters the dispatch mode alone."""
    try:
        from torch.utils.flop_counter import _FlopCounterMode
    except ImportError:  # pragma: no cover - the private mode moved; count with the public one
        _FlopCounterMode = None

    def enter(phase: str):
        counter = counters[phase]
        if _FlopCounterMode is None:
            counter.display = False
            return counter
        return _FlopCounterMode(counter)

    return enter


def measure_step(module: PlannedModule, inputs: Sequence[Any]) -> StepMeasurement:
    """One forward and backward of `module` on `inputs`, measured inside the graphs. The
    gradients accumulate into the parameters as in any step."""
    from torch.utils.flop_counter import FlopCounterMode

    register_cpu_attention()
    tracker = MemoryTracker()
    counters = {phase: FlopCounterMode(display=False) for phase in ("forward", "backward")}
    with module.instrument(lambda phase: tracker, flop_instrument(counters)) as calls:
        loss = module(*inputs)
        value = float(loss.detach())
        loss.backward()
        del loss
    _check_ran(calls)
    return StepMeasurement(
        peak=tracker.peak, peak_op=tracker.peak_op,
        forward_flops=counters["forward"].get_total_flops(),
        backward_flops=counters["backward"].get_total_flops(),
        loss=value, forward_calls=calls.forward, backward_calls=calls.backward)


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
