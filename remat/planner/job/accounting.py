"""The whole step's peak from its parts, the activation allowance a budget leaves, and what to
say when nothing fits. Torch-free.

One meaning of "activations" (docs/memory-and-accuracy.md, "The memory model")
------------------------------------------------------------------------------
The **state** is the parameters, their gradients as a training loop keeps them in `.grad`,
master weights and optimizer state (sharded per `Training`). The **activations** are the rest
of the step's peak: `activation_budget`, `plan.activation_peak`, BudgetError's "smallest
activation peak" and the report all mean that, and nothing else.

The solver still sees when each gradient appears: the graph's parameter gradients are
`is_output` values of the Problem (under ZeRO-2/3 the shards that the reduce-scatters make, see
`remat.fx_passes.lowering.sharding`), live from the op that makes them to the end of the step. The
simulated peak therefore holds the gradients made before it. The state counts the gradients
whole, all step long, so the accounting takes the graph's gradient bytes that the state counts
(`graph_gradients`) out of the simulated peak:

    activation peak = simulated peak - graph_gradients
    allowance given to the solver = activation budget + graph_gradients
    step peak = state (gradients included) + activation peak + reserve + fragmentation margin

The state counts the graph's gradients when they are the `.grad` the optimizer reads: the
gradient dtype is the parameters' (fp32, pure bf16, autocast over fp32 weights), or the
gradients are sharded (the shards are made in the optimizer's dtype). Otherwise
(bf16-mixed and fp16 unsharded: fp32 accumulation buffers of their own) `graph_gradients` is 0:
the buffers are state and the graph's low-precision gradients are activations, both live at the
end of the backward before the low-precision ones are accumulated and dropped.

The step peak is an exact sum whatever the gradients' timing: state + activation peak = the
non-gradient state + the simulated peak, since the gradients counted whole in the state are
taken out of the simulated peak whole.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from remat.errors import BudgetError
from remat.planner.job.budget import format_size
from remat.planner.job.training import StateMemory, Training
from remat.solvers import Problem, Schedule


@dataclass(frozen=True)
class StepMemory:
    """The memory of one training step under one schedule, by term, in bytes."""

    state: StateMemory
    simulated_peak: int
    """The simulator's peak of the Problem's values under the schedule (gradients included)."""
    graph_gradients: int
    """Bytes of the graph's gradients that the state's gradients term counts (module doc)."""
    gradients_in_graph: bool
    """Whether the state's gradients are the graph's own (or their shards) rather than buffers
    of their own."""
    reserve: int
    margin: int
    budget: int | None = None
    """The whole-step budget, None when only the activations were bounded."""
    compiled_excess: int = 0
    """Bytes the allocator measured above the simulated peak (negative: below) when Inductor
    ran the plan, its own buffers and fused kernels (`remat.planner.plans.inductor_check`), so
    that the activation peak is the allocator's; 0 for a plan run op by op."""

    @property
    def activation_peak(self) -> int:
        """The step's peak less the state: what `activation_budget` bounds."""
        return self.simulated_peak - self.graph_gradients + self.compiled_excess

    @property
    def static(self) -> int:
        """The state, per rank."""
        return self.state.total

    @property
    def counted_reserve(self) -> int:
        """The reserve, when the budget is the whole step's; an activation budget leaves it
        out of the total (it bounds the activations, not the device)."""
        return self.reserve if self.budget is not None else 0

    @property
    def total(self) -> int:
        return self.static + self.activation_peak + self.counted_reserve + self.margin

    @property
    def fits(self) -> bool:
        return self.budget is None or self.total <= self.budget

    def rows(self) -> list[tuple[str, int, bool, str]]:
        """(term, bytes, added to the total, note): the breakdown the report prints."""
        s = self.state
        grads_note = ("the .grad the optimizer reads (the graph's, or the shards its "
                      "reduce-scatters leave): state, not activations"
                      if self.gradients_in_graph else
                      "fp32 buffers of their own; the graph's low-precision gradients are "
                      "activations until accumulated")
        params_note = f"{s.parameters:,} parameters"
        if not s.weights and s.master:
            params_note += ("; no low-precision copy of their own: the fp32 shards (master "
                            "weights) are all-gathered in bf16, inside the activations")
        rows = [("parameters", s.weights, True, params_note)]
        if s.cast_copies:
            rows.append(("autocast weight copies", s.cast_copies, True,
                         "low-precision copies held for the backward"))
        rows += [
            ("gradients", s.gradients, True, grads_note),
            ("master weights", s.master, True, "fp32 copy of trainable parameters"),
            ("optimizer state", s.optimizer, True, ""),
            *([("gradient buckets", s.buckets, True, "DDP's all-reduce buckets: one more copy "
                "of the gradients")] if s.buckets else []),
            *([("batch and buffers", s.batch + s.buffers, True, "the micro-batch's tensors and "
                "the modules' buffers, held all step")] if s.batch + s.buffers else []),
            ("activation peak", self.activation_peak, True,
             "simulated; the step's peak less the state" if not self.compiled_excess else
             f"the allocator's under Inductor ({self.compiled_excess:+,} B from the "
             "simulated); the step's peak less the state"),
            ("reserve", self.reserve, self.budget is not None,
             "CUDA context and workspaces" if self.budget is not None else
             "not added: only the activations were bounded"),
            ("fragmentation margin", self.margin, True, ""),
        ]
        return rows

    def to_dict(self) -> dict:
        return {"state": self.state.to_dict(), "activation_peak": self.activation_peak,
                "simulated_peak": self.simulated_peak, "compiled_excess": self.compiled_excess,
                "graph_gradients": self.graph_gradients,
                "gradients_in_graph": self.gradients_in_graph, "static": self.static,
                "reserve": self.reserve, "counted_reserve": self.counted_reserve,
                "margin": self.margin, "total": self.total, "budget": self.budget,
                "fits": self.fits}


def graph_gradients(problem: Problem) -> int:
    """Bytes of the storages of the parameters' gradients in `problem` (the ops named in
    `problem.source["param_gradients"]`, each storage once)."""
    names = problem.source.get("param_gradients", ())
    roots = {problem.root[problem.index(n)] for n in names}
    return sum(problem.ops[r].size for r in roots)


def step_memory(schedule: Schedule, state: StateMemory, training: Training, *,
                graph_gradients: int, gradients_in_graph: bool, budget: int | None) -> StepMemory:
    return StepMemory(state=state, simulated_peak=schedule.peak, graph_gradients=graph_gradients,
                      gradients_in_graph=gradients_in_graph, reserve=training.reserve,
                      margin=training.margin(budget) if budget is not None else 0, budget=budget)


def fixed_bytes(state: StateMemory, training: Training) -> int:
    """What the step holds besides the activations, the margin aside: the state, the reserve."""
    return state.total + training.reserve


def activation_allowance(budget: int, state: StateMemory, training: Training) -> int:
    """Bytes the activations may peak at under a whole-step `budget` (may be negative)."""
    return budget - fixed_bytes(state, training) - training.margin(budget)


def smallest_budget(activation_peak: int, state: StateMemory, training: Training) -> int:
    """The smallest whole-step budget whose allowance holds `activation_peak`."""
    need = fixed_bytes(state, training) + activation_peak
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
    "gradient buckets": ("DistributedDataParallel(..., gradient_as_bucket_view=True) makes the "
                         ".grad views of the buckets, or shard the gradients (ZeRO-2/FSDP)"),
    "activations": ("recompute more (the optimal strategy recomputes all it may), or use a "
                    "smaller micro-batch with gradient accumulation to keep the global batch"),
    "reserve": ("lower Training(reserve=...) (1 GiB by default: CUDA context and library "
                "workspaces) to what the device's runtime really takes, or give a larger budget"),
    "fragmentation margin": "lower Training(fragmentation=...) if the allocator allows",
}


def budget_error(budget: int, *, smallest_activations: int | None, state: StateMemory,
                 training: Training, strategy: str = "", proof: str = "",
                 proven: bool | None = None) -> BudgetError:
    """The BudgetError for a whole-step `budget` that no schedule fits: the smallest budget that
    fits, the largest term and the remedy that acts on it (`REMEDIES`). Where the state alone
    overflows, the largest term is a state term or the reserve, never the activations: a
    smaller batch would not help then.

    `smallest_activations` is the smallest activation peak any schedule reaches (the step's
    peak less the state; None when the strategy did not say), found by `strategy`; `proof`
    says whether it is proven the least or only found (`BudgetError.proven`: `proven`)."""
    margin = training.margin(budget)
    state_terms = {
        "parameters": state.weights,
        "autocast weight copies": state.cast_copies,
        "master weights": state.master,
        "optimizer state": state.optimizer,
        "gradients": state.gradients,
        "gradient buckets": state.buckets,
    }
    overhead = {"reserve": training.reserve, "fragmentation margin": margin}
    state_alone = fixed_bytes(state, training) + margin
    activations = max(0, smallest_activations or 0)
    sizes = {**state_terms, "activations": activations, **overhead}
    if state.weights > budget:
        dominant = "parameters"
    elif state_alone > budget:
        # The state alone overflows: the culprit is a state term or the reserve, never the batch.
        dominant = max((t for t in sizes if t != "activations"), key=sizes.get)
    else:
        dominant = max(sizes, key=sizes.get)
    remedy = REMEDIES[dominant]
    smallest = None
    if smallest_activations is not None:
        smallest = smallest_budget(activations, state, training)
    parts = ", ".join(f"{name} {format_size(size)}" for name, size in state_terms.items() if size)
    lines = [
        f"no plan fits the budget of {format_size(budget)} ({budget:,} bytes) for the whole step",
        f"  the state: {parts or 'nothing'}; reserve {format_size(training.reserve)}, "
        f"fragmentation margin {format_size(margin)}",
    ]
    if state_alone > budget:
        lines.append(f"  the state with the reserve and margin needs {format_size(state_alone)}, "
                     "more than the budget, whatever the plan and the batch")
    if smallest_activations is not None:
        how = f" ({strategy})" if strategy else ""
        lines.append(f"  the smallest activation peak{how}: {format_size(activations)} (the "
                     "step's peak less the state)")
        lines.append(f"  the smallest budget that fits: {format_size(smallest)} "
                     f"({smallest:,} bytes)" + (f", {proof}" if proof else ""))
    lines.append(f"  the largest term is {dominant} ({format_size(sizes[dominant])}): {remedy}")
    return BudgetError("\n".join(lines), budget=budget, smallest=smallest, dominant=dominant,
                       remedy=remedy, proven=proven)
