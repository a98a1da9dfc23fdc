"""A compiled plan run by Inductor, accepted only on the allocator's reading of its step.

`optimize(..., compile=True)` plans the joint graph op by op, as for `compile=False`, then
hands the partitioned graphs to Inductor (`remat.fx_passes.compiled.inductor`) and runs one
training step on the example inputs under the allocator (torch.profiler's memory events on
the CPU, ``max_memory_allocated`` on CUDA). Inductor fuses pointwise chains (their
intermediates never reach memory) and plans its own buffers, so its peak is not the
simulator's: on the plans measured it was below (`benchmarks/inductor.py`), but nothing proves
it cannot be above. So the reading decides:
- at most the simulated peak: the plan stands, its report as simulated (an upper bound);
- above it but within the budget: the plan stands, its activation peak raised to the reading
  (`StepMemory.compiled_excess`), so the report's peak is what the allocator saw;
- above the budget: the plan is made again with the excess kept free below the budget's
  allowance (`plan_prepared(..., allowance_cut=)`), compiled and read again, at most
  `MAX_REPAIRS` times; then a BudgetError names what was measured.

Why measure rather than model Inductor's buffers: Inductor's memory plan is made inside its
scheduler after fusion, reordering and layout choices that change between torch releases;
the allocator reads what really ran, on the torch that runs it. The measured step changes
nothing the user sees: gradients, buffers (BatchNorm's running statistics) and the random
generators are put back as they were.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from remat.errors import BudgetError, RematError
from remat.planner.job.budget import format_size

log = logging.getLogger(__name__)

__all__ = ["InductorCheck", "InductorReading", "MAX_REPAIRS", "check_compile_setup",
           "compiled_plan"]

MAX_REPAIRS = 3


@dataclass(frozen=True)
class InductorReading:
    """One plan compiled by Inductor and run once: activation peaks in bytes (the step's peak
    less the gradients it leaves, as `StepMemory.activation_peak`)."""

    allowance_cut: int  # bytes the plan kept free below the budget's allowance
    predicted: int  # the simulator's activation peak of the plan
    measured: int  # the allocator's, under Inductor


@dataclass(frozen=True)
class InductorCheck:
    """The readings behind a compiled plan, the accepted plan's last."""

    readings: tuple[InductorReading, ...]

    @property
    def measured(self) -> int:
        return self.readings[-1].measured

    @property
    def predicted(self) -> int:
        return self.readings[-1].predicted

    def note(self) -> str:
        last = self.readings[-1]
        verdict = ("within the simulated peak" if last.measured <= last.predicted else
                   f"{format_size(last.measured - last.predicted)} above the simulated peak, "
                   "counted in the activation peak")
        repaired = (f" after {len(self.readings) - 1} re-plan(s) keeping "
                    f"{format_size(last.allowance_cut)} free for Inductor's excess"
                    if len(self.readings) > 1 else "")
        return (f"compiled by Inductor: one step read {format_size(last.measured)} of "
                f"activations by the allocator against {format_size(last.predicted)} simulated "
                f"op by op ({verdict}){repaired}")

    def to_dict(self) -> dict:
        return {"readings": [dataclasses.asdict(r) for r in self.readings]}

    @classmethod
    def from_dict(cls, saved: dict) -> "InductorCheck":
        return cls(tuple(InductorReading(**r) for r in saved["readings"]))


def check_compile_setup(*, execution: str, dynamic: Any, offload: bool, training: Any,
                        meta_weights: bool) -> None:
    """Refuse, before any capture, what compile=True cannot honour, with what to do instead."""
    if execution != "compiled":
        raise RematError("compile=True compiles the planned step of execution=\"compiled\"; an "
                         "eager plan is compiled by the user: model = plan.apply(model), then "
                         "torch.compile(model) or plan.compile_blocks(model)")
    if dynamic is not None:
        raise RematError("compile=True plans fixed shapes: the plan is accepted on one "
                         "measured step of the example's shapes; plan without dynamic=, or "
                         "with compile=False (op by op)")
    if offload:
        raise RematError("compile=True with offload=True is not supported: Inductor would "
                         "compile the copy-stream transfers the plan times; plan with "
                         "compile=False (op by op) to offload")
    if training.zero_stage >= 3 or training.data_parallel > 1:
        raise RematError("compile=True measures the compiled step in this process, which "
                         "holds no other rank's shards or all-reduce buckets; plan a "
                         "data-parallel job with compile=False (op by op), or with "
                         "execution=\"eager\" and compile the applied model")
    if meta_weights:
        raise RematError("compile=True runs one compiled step to measure it, which needs real "
                         "weights; this model's parameters are meta or fake tensors: load or "
                         "initialize the weights, or plan with compile=False")


def compiled_plan(plan: Any, model: Any, replan: Callable[[int], Any],
                  example_inputs: Sequence[Any], example_kwargs: dict) -> Any:
    """`plan` (a compiled-mode Plan of `model`) compiled by Inductor and accepted on the
    allocator's reading of one step, made again by ``replan(allowance_cut)`` while the
    reading is over the budget (module doc). The returned plan's `module` is the compiled
    step that was measured."""
    readings: list[InductorReading] = []
    cut = 0
    while True:
        plan.compile = True
        module = plan.apply(model)
        # The first call compiles (and Inductor's compile allocates): the second is the step.
        for _ in range(2):
            measured = measure_activations(module, model, example_inputs, example_kwargs)
        predicted = plan.memory.activation_peak
        readings.append(InductorReading(cut, predicted, measured))
        log.info("under Inductor: %s of activations measured, %s simulated",
                 format_size(measured), format_size(predicted))
        memory = dataclasses.replace(plan.memory, compiled_excess=max(0, measured - predicted))
        if _within(plan, memory):
            break
        if len(readings) > MAX_REPAIRS:
            raise _not_met(plan, readings)
        # A plan whose simulated peak is lower by what this one read over the budget: what
        # the allowance less this excess leaves (this plan was at most the allowance less
        # the last cut, so the new cut is larger).
        plan, cut = _replanned(plan, replan, readings, measured - predicted)
    plan.memory = memory
    plan.inductor = InductorCheck(tuple(readings))
    plan.__dict__["module"] = module  # the cached property: the step measured, compiled once
    return plan


def _within(plan: Any, memory: Any) -> bool:
    if plan.activation_budget is None:
        return memory.fits
    return memory.activation_peak <= plan.activation_budget


def _replanned(plan: Any, replan: Callable[[int], Any], readings: list[InductorReading],
               cut: int) -> tuple[Any, int]:
    """The plan made again with `cut` bytes kept free for Inductor's excess, or, where none
    keeps that much, the plan of the least simulated peak (Inductor's excess differs from
    plan to plan: the least may still fit), once."""
    try:
        return replan(cut), cut
    except BudgetError as e:
        least_cut = _cut_to(plan, e.smallest) if e.smallest is not None else None
        if least_cut is None or least_cut <= readings[-1].allowance_cut:
            raise _not_met(plan, readings, cut, e) from None
    try:
        return replan(least_cut), least_cut
    except BudgetError as e:
        raise _not_met(plan, readings, cut, e) from None


def _cut_to(plan: Any, smallest: int) -> int:
    """The allowance cut that leaves the solver exactly what a budget of `smallest` (in the
    plan's own terms: whole step, or activations alone) would."""
    prepared, budget = plan.prepared, plan.memory.budget
    if plan.activation_budget is None:
        return prepared.allowance(budget) - prepared.allowance(smallest)
    return plan.activation_budget - smallest


def _not_met(plan: Any, readings: list[InductorReading], cut: int = 0,
             cause: BudgetError | None = None) -> BudgetError:
    compiled = [f"{format_size(r.measured)} measured against {format_size(r.predicted)} "
                f"simulated" for r in readings]
    if cause is not None:
        compiled.append(f"no plan keeps {format_size(cut)} free "
                        f"below the allowance ({str(cause).splitlines()[0]})")
    least = min(readings, key=lambda r: r.measured)
    if plan.activation_budget is None:
        what, budget = "budget", plan.memory.budget
        others = plan.memory.total - plan.memory.activation_peak  # state, reserve, margin
        smallest = others + least.measured
    else:
        what, budget, smallest = "activation budget", plan.activation_budget, least.measured
    return BudgetError(
        f"under Inductor no plan was found within the {what} of {format_size(budget)}: "
        f"{'; '.join(compiled)}. The least found needs {format_size(smallest)} (found by "
        f"measurement, not proven least): raise the {what} to it, or plan with "
        f"compile=False, whose op-by-op step the simulator predicts exactly",
        budget=budget, smallest=smallest, proven=False)


def measure_activations(module: Any, model: Any, example_inputs: Sequence[Any],
                        example_kwargs: dict) -> int:
    """The allocator's activation peak of one step of `module` (the step's peak less the
    gradients it leaves), with the model's gradients, buffers and random generators put back
    as they were. Compiles on this first call."""
    import torch

    from remat.fx_passes.measuring.allocator import step_peak

    params = [p for p in model.parameters()]
    grads = [p.grad for p in params]
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    generators = _generator_states()
    device = next((p.device for p in params), torch.device("cpu"))
    try:
        for p in params:
            p.grad = None
        peak, held = step_peak(lambda: _Held(module(*example_inputs, **example_kwargs)),
                               lambda h, seed: h.loss.backward(seed), device)
        del held
        left = sum(p.grad.untyped_storage().nbytes() for p in params if p.grad is not None)
    finally:
        with torch.no_grad():
            for p, g in zip(params, grads):
                p.grad = g
            for b, saved in buffers:
                b.copy_(saved)
        _restore_generators(generators)
    return peak - left


class _Held:
    """The step's output, held through the backward as a training loop holds it, and its
    loss (what `plan.module` returns: the loss, or the model's output carrying it)."""

    def __init__(self, out: Any):
        import torch

        self.out = out
        self.loss = out if isinstance(out, torch.Tensor) else getattr(out, "loss", None)
        if self.loss is None:
            self.loss = out["loss"] if isinstance(out, dict) else out[0]


def _generator_states() -> tuple[Any, Any]:
    import torch

    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


def _restore_generators(states: tuple[Any, Any]) -> None:
    import torch

    cpu, cuda = states
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)
