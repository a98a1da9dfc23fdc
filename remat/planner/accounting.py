"""The whole step's peak from its parts, the activation allowance a budget leaves, and what to
say when nothing fits. Torch-free.

Where the gradients are counted, and why they are never counted twice
---------------------------------------------------------------------
The captured graph computes the parameter gradients itself: they are backward ops marked
`is_output`, and the simulator keeps them live from the op that makes them to the end of the
step (DESIGN.md, "The execution model"). So the simulated activation peak already holds every
gradient made before the peak, in the dtype the graph makes it in (the parameters' dtype).

Two cases follow, decided per configuration by `gradients_in_graph`:

- The gradients the optimizer reads *are* the graph's outputs (fp32 training, pure bf16,
  autocast over fp32 weights: gradient dtype == parameter dtype). They are counted once, inside
  the activation peak; the static term adds nothing for them. The report shows the gradients'
  size as a row, marked "in the activation peak", and does not add it to the total.
- The configuration keeps gradient storage of its own, distinct from the graph's outputs
  (bf16-mixed and fp16 keep fp32 accumulation buffers while the graph makes bf16/fp16
  gradients). Those buffers persist across the step, outside the graph, so the static term adds
  them, and the graph's low-precision gradients stay inside the activation peak: both exist at
  the end of the backward, before the low-precision ones are accumulated and dropped.

The step's peak is therefore

    weights + autocast copies + master + optimizer state + [gradient buffers, second case only]
    + simulated activation peak + reserve + fragmentation margin.

The peak of the step is reached at the peak of the activation timeline, since every other term
is constant over the step (ZeRO-3's per-layer all-gather buffers are not modelled; they belong
in the reserve).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from remat.errors import BudgetError
from remat.planner.budget import format_size
from remat.planner.training import StateMemory, Training
from remat.solvers import Phase, Problem, Schedule, simulate


@dataclass(frozen=True)
class StepMemory:
    """The memory of one training step under one schedule, by term, in bytes."""

    state: StateMemory
    activation_peak: int
    """The simulated peak of the captured graph's values under the schedule; it includes the
    graph's parameter gradients made before the peak (`gradients_at_peak`)."""
    gradients_at_peak: int
    """Bytes of the graph's gradients live at the activation peak."""
    gradients_in_graph: bool
    """Whether the configuration's gradients are the graph's outputs (counted in the activation
    peak) rather than buffers of their own (counted in the static term)."""
    reserve: int
    margin: int
    budget: int | None = None
    """The whole-step budget, None when only the activations were bounded."""

    @property
    def gradient_buffers(self) -> int:
        """Gradient bytes the static term adds: storage outside the graph, if any."""
        return 0 if self.gradients_in_graph else self.state.gradients

    @property
    def static(self) -> int:
        s = self.state
        return s.weights + s.cast_copies + s.master + s.optimizer + self.gradient_buffers

    @property
    def total(self) -> int:
        return self.static + self.activation_peak + self.reserve + self.margin

    @property
    def fits(self) -> bool:
        return self.budget is None or self.total <= self.budget

    def rows(self) -> list[tuple[str, int, bool, str]]:
        """(term, bytes, added to the total, note): the breakdown the report prints."""
        s = self.state
        grads_note = ("the graph's outputs: inside the activation peak, not added again"
                      if self.gradients_in_graph else
                      "buffers of their own (static); the graph's own gradients are inside "
                      "the activation peak")
        rows = [("parameters", s.weights, True, f"{s.parameters:,} parameters")]
        if s.cast_copies:
            rows.append(("autocast weight copies", s.cast_copies, True,
                         "low-precision copies held for the backward"))
        rows += [
            ("gradients", s.gradients, not self.gradients_in_graph, grads_note),
            ("master weights", s.master, True, "fp32 copy of trainable parameters"),
            ("optimizer state", s.optimizer, True, ""),
            ("activation peak", self.activation_peak, True,
             f"simulated; {format_size(self.gradients_at_peak)} of gradients live at it"),
            ("reserve", self.reserve, True, "CUDA context and workspaces"),
            ("fragmentation margin", self.margin, True, ""),
        ]
        return rows

    def to_dict(self) -> dict:
        return {"state": self.state.to_dict(), "activation_peak": self.activation_peak,
                "gradients_at_peak": self.gradients_at_peak,
                "gradients_in_graph": self.gradients_in_graph,
                "gradient_buffers": self.gradient_buffers, "static": self.static,
                "reserve": self.reserve, "margin": self.margin, "total": self.total,
                "budget": self.budget, "fits": self.fits}


def gradients_at_peak(problem: Problem, schedule: Schedule) -> tuple[int, int]:
    """(activation peak, bytes of the graph's outputs made in the backward that are live at it)."""
    timeline = simulate(problem, schedule)
    peak = timeline.peak
    if not timeline.steps:
        return 0, 0
    at = next(t for t, step in enumerate(timeline.steps) if step.live == peak)
    made = {step.op for step in timeline.steps[:at + 1]}
    root = problem.root
    grads = {root[i] for i, op in enumerate(problem.ops)
             if op.is_output and op.phase is Phase.BACKWARD and root[i] in made}
    return peak, sum(problem.ops[g].size for g in grads if problem.ops[g].phase is Phase.BACKWARD)


def step_memory(problem: Problem, schedule: Schedule, state: StateMemory, training: Training, *,
                gradients_in_graph: bool, budget: int | None) -> StepMemory:
    peak, grads = gradients_at_peak(problem, schedule)
    return StepMemory(state=state, activation_peak=peak, gradients_at_peak=grads,
                      gradients_in_graph=gradients_in_graph, reserve=training.reserve,
                      margin=training.margin(budget) if budget is not None else 0, budget=budget)


def fixed_bytes(state: StateMemory, training: Training, *, gradients_in_graph: bool) -> int:
    """What the step holds besides the activations, the margin aside."""
    grads = 0 if gradients_in_graph else state.gradients
    return (state.weights + state.cast_copies + state.master + state.optimizer + grads
            + training.reserve)


def activation_allowance(budget: int, state: StateMemory, training: Training, *,
                         gradients_in_graph: bool) -> int:
    """Bytes the activation timeline may peak at under a whole-step `budget` (may be negative)."""
    return (budget - fixed_bytes(state, training, gradients_in_graph=gradients_in_graph)
            - training.margin(budget))


def smallest_budget(activation_peak: int, state: StateMemory, training: Training, *,
                    gradients_in_graph: bool) -> int:
    """The smallest whole-step budget whose allowance holds `activation_peak`."""
    need = fixed_bytes(state, training, gradients_in_graph=gradients_in_graph) + activation_peak
    fits = lambda b: b - training.margin(b) >= need  # noqa: E731
    budget = math.ceil(need / (1 - training.fragmentation))
    while not fits(budget):  # float rounding of the margin, a step or two at most
        budget += 1
    while budget > need and fits(budget - 1):
        budget -= 1
    return budget


REMEDIES = {
    "parameters": ("split the model across devices (tensor or pipeline parallelism, or "
                   "ZeRO-3/FSDP to shard the weights); a smaller batch does not help"),
    "autocast weight copies": ("store the weights in bf16 (precision 'bf16-mixed' or 'bf16') "
                               "instead of autocasting fp32 weights"),
    "optimizer state": ("shard it across data-parallel ranks (ZeRO-1 or higher), or use a smaller "
                        "optimizer (8-bit Adam, Adafactor, Lion)"),
    "master weights": ("shard them with the optimizer state (ZeRO-1 or higher); a smaller batch "
                       "does not help"),
    "gradients": "shard them across data-parallel ranks (ZeRO-2 or higher)",
    "activations": ("recompute more (the optimal plan already recomputes all it may at the "
                    "smallest budget), or use a smaller micro-batch with gradient accumulation "
                    "to keep the global batch"),
    "reserve and margin": "lower Training(reserve=..., fragmentation=...) if the device allows",
}


def budget_error(budget: int, *, smallest_activations: int | None, state: StateMemory,
                 training: Training, gradients_in_graph: bool, gradients_in_peak: int = 0,
                 strategy: str = "") -> BudgetError:
    """The BudgetError for a whole-step `budget` that no schedule fits (MEMORY.md, "When the
    budget is not met"): the smallest budget that fits, the dominant term and its remedy.

    `smallest_activations` is the smallest activation peak any schedule reaches (None when the
    strategy did not say), `gradients_in_peak` the graph's gradients inside it, which belong to
    the gradients term, not the activations."""
    # The gradients term: buffers of their own (if any) and the graph's gradients inside the
    # smallest peak, which leave the activations term.
    grads = (0 if gradients_in_graph else state.gradients) + gradients_in_peak
    state_terms = {
        "parameters": state.weights,
        "autocast weight copies": state.cast_copies,
        "master weights": state.master,
        "optimizer state": state.optimizer,
        "gradients": grads,
    }
    margin = training.margin(budget)
    state_alone = (fixed_bytes(state, training, gradients_in_graph=gradients_in_graph)
                   + gradients_in_peak + margin)
    activations = max(0, (smallest_activations or 0) - gradients_in_peak)
    if state.weights > budget:
        dominant = "parameters"
    elif state_alone > budget:
        # The state alone overflows: only a state term can be the culprit, never the batch.
        dominant = max(state_terms, key=state_terms.get)
    else:
        terms = {**state_terms, "activations": activations,
                 "reserve and margin": training.reserve + margin}
        dominant = max(terms, key=terms.get)
    remedy = REMEDIES[dominant]
    smallest = None
    if smallest_activations is not None:
        smallest = smallest_budget(smallest_activations, state, training,
                                   gradients_in_graph=gradients_in_graph)
    parts = ", ".join(f"{name} {format_size(size)}" for name, size in state_terms.items() if size)
    lines = [
        f"no plan fits the budget of {format_size(budget)} ({budget:,} bytes) for the whole step",
        f"  the state: {parts}; reserve {format_size(training.reserve)}, "
        f"fragmentation margin {format_size(margin)}",
    ]
    if state_alone > budget:
        lines.append(f"  the state alone needs {format_size(state_alone)}, more than the budget, "
                     "whatever the plan and the batch")
    if smallest_activations is not None:
        how = f" ({strategy})" if strategy else ""
        lines.append(f"  the smallest activation peak{how}: {format_size(activations)} "
                     f"besides gradients")
        lines.append(f"  the smallest budget that fits: {format_size(smallest)} ({smallest:,} bytes)")
    lines.append(f"  the largest term is {dominant}: {remedy}")
    return BudgetError("\n".join(lines), budget=budget, smallest=smallest, dominant=dominant,
                       remedy=remedy)
