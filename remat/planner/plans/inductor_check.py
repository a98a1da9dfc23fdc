"""A compiled plan run by Inductor, accepted only on the allocator's reading of its step.

`optimize(..., compile=True)` plans the joint graph as for `compile=False`, in Inductor's forms
and with the values Inductor fuses away at no bytes (`remat.fx_passes.lowering.fusion`), then
hands the partitioned graphs to Inductor (`remat.fx_passes.compiled.inductor`) and runs one
training step on the example inputs under the allocator (torch.profiler's memory events on
the CPU, ``max_memory_allocated`` on CUDA). Inductor fuses more than that count knows (a
recomputed pointwise chain into its backward reader) and plans its own buffers, so its peak
is not the simulator's: below it on some plans, above on others (`benchmarks/inductor.py`). So the
reading decides, and is the plan's activation peak (`StepMemory.compiled_excess`, the
difference, negative where Inductor reads below): what the report shows is what the
allocator saw.
- Within the budget: the plan stands. Where its reading leaves room below what its allowance
  gave the solver (Inductor read below the simulation) and it recomputes, it is made once more
  with that room given back, compiled and read, and taken where it fits and recomputes fewer
  FLOPs (`_spend_room`): a Llama read 16 MiB below its simulation in every plan, room the
  plans otherwise paid for in recompute FLOPs.
- Over it: the plan is made again with the excess kept free below the budget's allowance
  (`plan_prepared(..., allowance_cut=)`), or the plan of the least simulated peak where none
  keeps that much, compiled and read again, at most `MAX_REPAIRS` times; then a BudgetError
  names what was measured.
- A budget below the least simulated peak: the least plan is compiled and read, and stands
  if Inductor's step fits (fusion keeps pointwise intermediates out of memory).
- The least simulated peak is searched, and the plan at it made, in deterministic mode
  (unless the options say otherwise; the wall-clock search's plan where that mode finds none
  at its least): plans of equal simulated peak and cost read differently under Inductor (a
  ViT: 18.57 and 19.79 MiB from two solves at one budget), and the wall-clock search's least
  moves with the machine's load (`_least_plan`). So the least a BudgetError names comes back
  when fed back, in any process, unless the wall clock cuts deterministic mode too (the
  plan's report says so).

Recomputations are planned just in time (`SolverOptions(free_positions=False)`): on a ViT
(2 layers, hidden 192, 224 px, batch 4) three least-peak plans with recomputations at free
backward positions, all simulated at 11.44 MB, read 12.13, 10.91 and 12.14 MB under Inductor
(a recomputation placed early, in a region Inductor fuses across, lives longer than the
simulator counts); two just-in-time plans read 10.93 MB both, for 6 % more recompute FLOPs.

The objective is the least recompute FLOPs (`SolverOptions(objective="flops")`, seconds
breaking ties): Inductor fuses a recomputed pointwise op (GELU, a norm's scaling) into its
reader, where a roofline of the op alone counts a kernel's memory traffic. On the ViT of
`benchmarks/inductor.py` (6 layers, batch 8) at 75.61 MiB, torch.compile's point at budget
0.8 with no FLOPs recomputed, the time objective's plan read 74.19 MiB recomputing 0.93
GFLOP of matmuls; the FLOPs objective's read 75.26 MiB recomputing none.

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
from remat.planner.plans.step_reading import step_reading

log = logging.getLogger(__name__)

__all__ = ["InductorCheck", "InductorReading", "MAX_REPAIRS", "check_compile_setup",
           "compiled_plan"]

MAX_REPAIRS = 3
# A plan whose reading leaves at least this share of it free below what its allowance gave the
# solver is made again once with that room (`_spend_room`).
ROOM_SHARE = 0.01


@dataclass(frozen=True)
class InductorReading:
    """One plan compiled by Inductor and run once: activation peaks in bytes (the step's peak
    less the gradients it leaves, as `StepMemory.activation_peak`)."""

    allowance_cut: int  # bytes the plan kept free below the budget's allowance
    predicted: int  # the simulator's activation peak of the plan
    measured: int  # the allocator's, under Inductor
    spent: bool = False  # planned again with the room a reading left below the budget


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

    @property
    def excess(self) -> int:
        """`StepMemory.compiled_excess` of the accepted plan: the reading less the simulation."""
        return self.measured - self.predicted

    def note(self) -> str:
        last = self.readings[-1]
        difference = last.measured - last.predicted
        verdict = (f"{format_size(-difference)} below the simulated peak" if difference <= 0
                   else f"{format_size(difference)} above the simulated peak")
        repaired = (f"; after {len(self.readings) - 1} re-plan(s), the solver's allowance "
                    f"cut by {format_size(last.allowance_cut)} for Inductor's excess"
                    if len(self.readings) > 1 else "")
        if last.spent:
            repaired = (f"; planned again with the solver's allowance raised by "
                        f"{format_size(-last.allowance_cut)}, what Inductor read below the "
                        "simulation, to recompute less")
        elif last.allowance_cut < 0:
            repaired = (f"; the plan of the least simulated peak, "
                        f"{format_size(-last.allowance_cut)} over the budget as simulated")
        return (f"compiled by Inductor: one step read {format_size(last.measured)} of "
                f"activations by the allocator against {format_size(last.predicted)} simulated "
                f"(what Inductor fuses away counted at no bytes; {verdict}; the activation "
                f"peak is the reading){repaired}")

    def to_dict(self) -> dict:
        return {"readings": [dataclasses.asdict(r) for r in self.readings]}

    @classmethod
    def from_dict(cls, saved: dict) -> "InductorCheck":
        return cls(tuple(InductorReading(**r) for r in saved["readings"]))


def check_compile_setup(*, dynamic: Any, offload: bool, training: Any,
                        meta_weights: bool) -> None:
    """Refuse, before any capture, what compile=True cannot honour, with what to do instead."""
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
                         "execution=\"eager\", compile=False, and compile the applied model "
                         "yourself (its compiled memory is then not predicted)")
    if meta_weights:
        raise RematError("compile=True runs one compiled step to measure it, which needs real "
                         "weights; this model's parameters are meta or fake tensors: load or "
                         "initialize the weights, or plan with compile=False")


def compiled_plan(model: Any, replan: Callable[..., Any], cut_to: Callable[[int], int],
                  example_inputs: Sequence[Any], example_kwargs: dict) -> Any:
    """The compiled-mode plan of `model` made by ``replan(allowance_cut)``, compiled by
    Inductor and accepted on the allocator's reading of one step, made again while the
    reading is over the budget (module doc). ``cut_to(smallest)`` is the cut that leaves the
    solver what a budget of `smallest` would; ``replan(cut, least=True)`` makes the plan at
    the least simulated peak in deterministic mode where it can (module doc). The returned
    plan's `module` is the compiled step that was measured, its activation peak the
    reading. An eager plan (execution="eager") is read as its user runs it: applied to `model`
    and compiled by ``torch.compile`` (`remat.planner.plans.step_reading`)."""
    refused = None
    try:
        plan, cut = replan(0), 0
    except BudgetError as e:
        if e.smallest is None:
            raise
        # Fused, Inductor's step may read below the least simulated peak: that plan is tried.
        plan, cut, refused = _least_plan(replan, cut_to, 0, e)
    readings: list[InductorReading] = []
    while True:
        module, measured = step_reading(plan, model, example_inputs, example_kwargs)
        predicted = plan.memory.activation_peak
        readings.append(InductorReading(cut, predicted, measured))
        memory = dataclasses.replace(plan.memory, compiled_excess=measured - predicted)
        if _within(plan, memory):
            break
        if refused is not None or len(readings) > MAX_REPAIRS:
            raise _not_met(plan, readings, cut, refused)
        # A plan whose simulated peak is lower by what this one read over the budget: what
        # the allowance less this excess leaves (this plan was at most the allowance less
        # the last cut, so the new cut is larger).
        plan, cut = _replanned(plan, replan, cut_to, readings, measured - predicted)
    plan, module, readings = _spend_room(plan, module, readings, model, replan, example_inputs,
                                         example_kwargs)
    plan.inductor = InductorCheck(tuple(readings))
    plan.memory = dataclasses.replace(plan.memory, compiled_excess=plan.inductor.excess)
    if module is not None:  # the cached property: the step measured, compiled once
        plan.__dict__["module"] = module
    return plan


def _spend_room(plan: Any, module: Any, readings: list[InductorReading], model: Any,
                replan: Callable[..., Any], example_inputs: Sequence[Any],
                example_kwargs: dict) -> tuple[Any, Any, list[InductorReading]]:
    """The accepted plan, or where its reading leaves room below the budget that its cut did
    not give the solver (the compiled step read below the prediction) and it recomputes, the
    plan made again with the allowance cut by the excess alone, compiled and read: taken where
    it fits and recomputes less (`_recomputes`), and then its own room given back in turn, at most
    `MAX_REPAIRS` times; the last plan that fits stands (its reading last). On a Llama every
    plan read 16,773,116 bytes below its simulation, so each left 16 MiB of its budget unused
    and recomputed FLOPs torch.compile did not at the same memory (`benchmarks/inductor.py
    --models llama`); an eager plan under torch.compile read 51 MiB where its eager timeline
    said 83 (`benchmarks/gpu_check.py --checks applied`), room a single step does not use up."""
    for _ in range(MAX_REPAIRS):
        spent = _spend_once(plan, readings, model, replan, example_inputs, example_kwargs)
        if spent is None:
            break
        reading, other, other_module = spent
        if other is None:  # over the budget: the plan before stands, its reading last
            readings = [*readings[:-1], reading, readings[-1]]
            break
        plan, module, readings = other, other_module, [*readings, reading]
    return plan, module, readings


def _spend_once(plan: Any, readings: list[InductorReading], model: Any,
                replan: Callable[..., Any], example_inputs: Sequence[Any],
                example_kwargs: dict) -> tuple[InductorReading, Any, Any] | None:
    """One step of `_spend_room`: None where there is nothing to gain, else the reading of the
    plan made with the room and (that plan, its module) where it fits, (None, None) where
    not."""
    last = readings[-1]
    excess = last.measured - last.predicted
    if _recomputes(plan) <= (0, 0) or last.allowance_cut - excess < ROOM_SHARE * last.measured:
        return None
    try:
        other = replan(excess)
    except BudgetError:
        return None
    if _recomputes(other) >= _recomputes(plan):  # nothing to gain: no compile
        return None
    other_module, measured = step_reading(other, model, example_inputs, example_kwargs)
    reading = InductorReading(excess, other.memory.activation_peak, measured, spent=True)
    memory = dataclasses.replace(other.memory,
                                 compiled_excess=measured - other.memory.activation_peak)
    if _within(other, memory):
        return reading, other, other_module
    log.info("compiled: the plan with the room given back read %s, over the budget; the "
             "plan before it stands", format_size(measured))
    return reading, None, None


def _recomputes(plan: Any) -> tuple[int, float]:
    """What a plan recomputes, compared FLOPs first (the objective under compile), then
    seconds: a plan recomputing pointwise ops alone costs no FLOPs and still costs time."""
    return plan.recompute_flops, plan.schedule.cost


def _within(plan: Any, memory: Any) -> bool:
    if plan.activation_budget is None:
        return memory.fits
    return memory.activation_peak <= plan.activation_budget


def _replanned(plan: Any, replan: Callable[..., Any], cut_to: Callable[[int], int],
               readings: list[InductorReading], cut: int) -> tuple[Any, int]:
    """The plan made again with `cut` bytes kept free for Inductor's excess, or, where none
    keeps that much, the plan of the least simulated peak (Inductor's excess differs from
    plan to plan: the least may still fit), once."""
    try:
        return replan(cut), cut
    except BudgetError as e:
        if e.smallest is None:
            raise _not_met(plan, readings, cut, e) from None
        refused = e
    try:
        least, least_cut, refused = _least_plan(replan, cut_to, cut, refused,
                                                above=readings[-1].allowance_cut)
    except BudgetError as e:
        raise _not_met(plan, readings, cut, e) from None
    return least, least_cut


def _least_plan(replan: Callable[..., Any], cut_to: Callable[[int], int], cut: int,
                refused: BudgetError, above: int | None = None
                ) -> tuple[Any, int, BudgetError | None]:
    """(plan, its cut, the refusal or None) for an allowance less `cut` that the wall-clock
    search found no plan within (`refused`): the least peak searched again in deterministic
    mode, and the plan of that least simulated peak made in deterministic mode too. The
    wall-clock search's least differs with the machine's load, and so does the plan made at
    it: on a Llama (`benchmarks/inductor.py --models llama`) the wall-clock search named
    57,696,264 bytes where the deterministic one named 57,692,168, and plans made at least
    peaks a few bytes apart read 17.98 and 20.62 MB under Inductor. Searched in deterministic
    mode, the figure and the plan at it are the same in any process (unless the wall clock
    cuts that mode too, which the plan's report says). Where that search finds a plan within
    the allowance after all, it is taken (refusal None). `above`: a cut the least must be
    above (a re-plan that would not keep more free), else the refusal is raised."""
    try:
        return replan(cut, least=True, fallback=False), cut, None
    except BudgetError as e:
        if e.smallest is not None:
            refused = e
    least_cut = cut_to(refused.smallest)
    if above is not None and least_cut <= above:
        raise refused
    return replan(least_cut, least=True), least_cut, refused


def _not_met(plan: Any, readings: list[InductorReading], cut: int = 0,
             cause: BudgetError | None = None) -> BudgetError:
    compiled = [f"{format_size(r.measured)} measured against {format_size(r.predicted)} "
                f"simulated" for r in readings]
    if cause is not None and cut > 0:
        compiled.append(f"no plan keeps {format_size(cut)} free "
                        f"below the allowance ({str(cause).splitlines()[0]})")
    elif cause is not None:
        compiled.insert(0, f"op by op, {str(cause).splitlines()[0]}; the plan of the least "
                           "simulated peak, compiled, read")
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
