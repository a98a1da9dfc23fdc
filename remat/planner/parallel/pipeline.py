"""`plan_pipeline`: per-stage plans for pipeline-parallel training with
`torch.distributed.pipelining`, each stage planned for its schedule and its rank's budget.

How a rank's memory is predicted (docs/parallelism.md): the schedule's action order for the
rank (`remat.fx_passes.lowering.pipeline_order`), each stage's memory for one micro-batch under
a candidate plan (`remat.planner.parallel.stage`: remat's eager timeline of the stage's step;
`remat.planner.parallel.split` for the split backward of zero-bubble schedules), composed over
the order (`remat.solvers.timeline.pipeline_rank.compose`), plus what the rank holds anyway: the
stages' state (parameters, optimizer state; the gradients are counted from the stage's first
backward), the runtime's receive buffers (one input and one output gradient per micro-batch,
allocated before the first step and kept) and the micro-batches' inputs and targets.

Stages get different plans: a stage that holds more micro-batches at once (the first ones
under 1F1B) or more state has less room for each. For each rank the plan takes the combination
of its stages' candidates with the least recompute (FLOPs) whose composed peak fits the rank's
budget.
"""
from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

from remat.errors import BudgetError, RematError
from remat.planner.job.budget import format_size, parse_size
from remat.planner.parallel.fsdp import (check_fsdp_in_pipeline, sharded_in_pipeline,
                                         stage_units, unsharded_training, with_fsdp)
from remat.planner.parallel.stage import Candidate, ladder
from remat.planner.job.training import Training
from remat.solvers import SolverOptions
from remat.solvers.timeline.pipeline_rank import RankMemory, compose

log = logging.getLogger(__name__)

__all__ = ["PipelinePlan", "PipelineSpec", "StagePlan", "plan_pipeline"]


@dataclass(frozen=True, kw_only=True)
class PipelineSpec:
    """The pipeline the stages run in."""

    schedule: str = "1F1B"
    """A `torch.distributed.pipelining` schedule: "GPipe", "1F1B", "Interleaved1F1B",
    "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"."""
    microbatches: int = 1
    """Micro-batches a step; `example_inputs` is one of them."""
    ranks: int | None = None
    """Pipeline ranks (default: one stage a rank for GPipe and 1F1B, two for the others)."""

    def __post_init__(self) -> None:
        if isinstance(self.microbatches, bool) or not isinstance(self.microbatches, int) \
                or self.microbatches < 1:
            raise ValueError(f"microbatches must be an int >= 1, not {self.microbatches!r}")


@dataclass(frozen=True)
class StagePlan:
    stage: int
    rank: int
    chosen: Candidate
    candidates: tuple[Candidate, ...]
    static: dict[str, int]
    """What the stage holds whatever the plan (bytes by term; the gradients are in the
    composition)."""

    @property
    def policies(self) -> dict:
        """Block path (in the stage module) -> BlockPolicy: `apply_eager(stage, policies)`."""
        return self.chosen.policies

    @property
    def recompute_flops(self) -> int:
        """FLOPs the stage recomputes in one step (all its micro-batches)."""
        return self.chosen.recompute_flops


@dataclass
class PipelinePlan:
    spec: PipelineSpec
    order: Any  # remat.fx_passes.lowering.pipeline_order.ScheduleOrder
    stages: list[StagePlan]
    ranks: dict[int, RankMemory]
    budgets: dict[int, int]
    training: Training
    margins: dict[int, int] = field(default_factory=dict)
    handoffs: dict = field(default_factory=dict)
    """Rank -> what its runtime keeps of the tensors handed on
    (`remat.solvers.timeline.pipeline_rank.Kept`)."""
    sizes: dict = field(default_factory=dict)
    """Stage -> (bytes of its output, bytes of its input's gradient, bytes of its loss: the
    last stage's) for one micro-batch."""
    smallest: dict = field(default_factory=dict)
    """Rank -> the smallest whole-step budget any combination of its candidates fits."""
    fsdp_units: dict = field(default_factory=dict)
    """Stage -> its FSDP2 units (`remat.planner.parallel.fsdp.StageUnits`) when the stages are
    sharded over data-parallel ranks (`Training(zero_stage=3, data_parallel > 1)`)."""

    def static(self, rank: int) -> int:
        return sum(sum(s.static.values()) for s in self.stages if s.rank == rank)

    def peak(self, rank: int) -> int:
        """The rank's predicted whole-step peak: what it holds anyway, the composed
        activations and gradients (without the reserve and margin)."""
        return self.static(rank) + self.ranks[rank].peak

    def apply(self, stage_modules: Sequence[Any]) -> list[Any]:
        """Each stage's blocks wrapped in place with its policies (or plain checkpoint)."""
        from remat.fx_passes.eager.apply import apply_eager
        from remat.planner.parallel.split import checkpoint_whole

        for plan, module in zip(self.stages, stage_modules):
            if plan.chosen.whole:
                checkpoint_whole(module, plan.chosen.whole)
            elif plan.chosen.policies:
                apply_eager(module, plan.chosen.policies)
        return list(stage_modules)

    def prepare_runtime(self, pipeline_stages: Sequence[Any]) -> list[Any]:
        """The `PipelineStage`s of this rank ready for the plan: under a schedule that splits
        the backward, each W runs in one recomputation group
        (`remat.fx_passes.eager.pipeline_apply.group_weight_recomputation`)."""
        if self.order.split_backward:
            from remat.fx_passes.eager.pipeline_apply import group_weight_recomputation

            for stage in pipeline_stages:
                group_weight_recomputation(stage)
        return list(pipeline_stages)

    def rows(self) -> list[dict]:
        return [{"stage": s.stage, "rank": s.rank, "plan": s.chosen.name,
                 "in_flight": self.ranks[s.rank].in_flight.get(s.stage, 0),
                 "recompute_flops": s.recompute_flops * self.spec.microbatches,
                 "rank_peak": self.peak(s.rank), "budget": self.budgets[s.rank]}
                for s in self.stages]


def _stage_inputs(stages: Sequence[Any], first: tuple, microbatches: int):
    """Each stage's micro-batch inputs and output (for the next stage's and the receive
    buffers' shapes): the stages run once under no_grad (on meta weights, nothing runs)."""
    import torch

    inputs, outputs = [tuple(first)], []
    with torch.no_grad():
        for k, stage in enumerate(stages):
            out = stage(*inputs[-1])
            if not isinstance(out, torch.Tensor):
                raise RematError(f"stage {k} returns {type(out).__name__}: plan_pipeline plans "
                                 "stages that take and return one tensor")
            outputs.append(out)
            inputs.append((torch.zeros_like(out).requires_grad_(),))
    return inputs[:-1], outputs


def _nbytes(t) -> int:
    return t.numel() * t.element_size()


def plan_pipeline(stages: Sequence[Any], example_inputs: Sequence[Any], *, example_target: Any,
                  loss_fn: Callable, budget: int | str | Sequence[int | str],
                  spec: PipelineSpec = PipelineSpec(), training: Training = Training(),
                  target: str = "h100", levels: int = 5,
                  solver_options: SolverOptions | None = None,
                  reuse: PipelinePlan | None = None) -> PipelinePlan:
    """Plans for every stage of a pipeline (module doc). `stages` are the stage modules in
    order; `example_inputs` the first stage's inputs for one micro-batch and `example_target`
    the last stage's target for it; `loss_fn(output, target)` the schedule's loss; `budget`
    the whole step's budget of each rank (one for all, or one a rank). `levels` is how many
    plans each stage is costed at. `reuse`: a plan of the same stages and micro-batches whose
    stage candidates serve again (another budget, or another schedule that splits the
    backward as its did). Raises BudgetError naming the rank, its smallest budget and its
    largest term when a rank's stages cannot fit."""
    from remat.fx_passes.lowering.pipeline_order import schedule_actions
    from remat.fx_passes.tracing.stage_step import PREFIX, StageStep
    from remat.planner.plans.prepare import prepare
    from remat.planner.job.training import state_memory
    import torch

    from remat.planner.job.tensor_layout import check_tensor_parallel

    for stage in stages:  # Training(tensor_parallel=...) against each stage's layout
        check_tensor_parallel(stage, training)
    order = schedule_actions(spec.schedule, ranks=spec.ranks or _default_ranks(spec, stages),
                             microbatches=spec.microbatches, stages=len(stages))
    _warn_zbv_on_gloo(spec.schedule)
    check_fsdp_in_pipeline(training, order.split_backward)
    budgets = _budgets(budget, order.ranks)
    units = {k: stage_units(stage, training) for k, stage in enumerate(stages)} \
        if sharded_in_pipeline(training) else {}
    passes = unsharded_training(training)  # a micro-batch's passes: no sharding (FSDP2 doc)
    m = spec.microbatches
    if reuse is not None:
        if (reuse.order.split_backward != order.split_backward or len(reuse.stages) != len(stages)
                or reuse.spec.microbatches != m):
            raise RematError("plan_pipeline(reuse=...): that plan is for other stages, "
                             "micro-batches or a schedule that splits the backward otherwise")
        plans = [(s.stage, list(s.candidates), s.static) for s in reuse.stages]
        return _finish(spec, order, plans, budgets, training, reuse.sizes, units)
    inputs, outputs = _stage_inputs(stages, tuple(example_inputs), m)
    last = len(stages) - 1
    plans = []
    for k, stage in enumerate(stages):
        is_last = k == last
        step = StageStep(stage, loss_fn=loss_fn if is_last else None,
                         output_grad=None if is_last else torch.zeros_like(outputs[k]))
        args = inputs[k] + ((example_target,) if is_last else ())
        state = state_memory(stage, training)
        static = {"parameters": state.weights + state.cast_copies, "master": state.master,
                  "optimizer": state.optimizer,
                  "receive buffers": m * ((_nbytes(inputs[k][0]) if k else 0)
                                          + (0 if is_last else _nbytes(outputs[k]))),
                  "batch": m * ((sum(_nbytes(x) for x in inputs[0]) if k == 0 else 0)
                                + (_nbytes(example_target) if is_last else 0))}
        if order.split_backward and k != 0:
            from remat.planner.parallel.split import split_candidates

            candidates = split_candidates(step, args, prefix=PREFIX)
        else:
            if any(hasattr(p, "placements") for p in stage.parameters()):  # TP inside
                from remat.planner.parallel.tensor_parallel import prepare_tensor_parallel

                prepared = prepare_tensor_parallel(step, args, training=passes, target=target,
                                                   returns="output")
            else:
                prepared = prepare(step, args, training=passes, target=target,
                                   returns="output")
            candidates = ladder(step, prepared, levels=levels, target=target,
                                solver_options=solver_options, example_inputs=args,
                                prefix=PREFIX)
            if order.split_backward:  # the first stage: its whole backward runs at W
                from remat.planner.parallel.split import whole_backward_at_weight

                candidates = [replace(c, memory=whole_backward_at_weight(c.memory))
                              for c in candidates]

        plans.append((k, candidates, static))
    with torch.no_grad():
        loss = _nbytes(loss_fn(outputs[last], example_target))
    sizes = {k: (_nbytes(outputs[k]), _nbytes(inputs[k][0]) if k else 0,
                 loss if k == last else 0) for k in range(len(stages))}
    return _finish(spec, order, plans, budgets, training, sizes, units)


def _finish(spec, order, plans, budgets, training, sizes, units) -> PipelinePlan:
    handoffs = {r: order.kept(r, {k: o for k, (o, _, _) in sizes.items()},
                              {k: g for k, (_, g, _) in sizes.items()},
                              sum(loss for _, _, loss in sizes.values()))
                for r in range(order.ranks)}
    chosen, ranks, margins, smallest = _choose(plans, order, budgets, training,
                                               spec.microbatches, handoffs, units)
    stage_plans = [StagePlan(k, order.stage_rank[k], chosen[k], tuple(c), static)
                   for k, c, static in plans]
    return PipelinePlan(spec, order, stage_plans, ranks, budgets, training, margins, handoffs,
                        sizes, smallest, units)


def _default_ranks(spec: PipelineSpec, stages: Sequence[Any]) -> int:
    return len(stages) if spec.schedule in ("GPipe", "1F1B") else max(1, len(stages) // 2)


def _budgets(budget, ranks: int) -> dict[int, int]:
    if isinstance(budget, (list, tuple)):
        if len(budget) != ranks:
            raise ValueError(f"budget: {len(budget)} budgets for {ranks} ranks")
        return {r: parse_size(b) for r, b in enumerate(budget)}
    return {r: parse_size(budget) for r in range(ranks)}


def _choose(plans, order, budgets, training: Training, m: int, handoffs, units):
    """Per rank, the combination of its stages' candidates with the least recompute FLOPs whose
    composed peak fits (module doc)."""
    chosen: dict[int, Candidate] = {}
    ranks: dict[int, RankMemory] = {}
    margins: dict[int, int] = {}
    smallest: dict[int, int] = {}
    by_stage = {k: (candidates, static) for k, candidates, static in plans}
    for rank in range(order.ranks):
        mine = order.stages_of(rank)
        static = sum(sum(by_stage[k][1].values()) for k in mine)
        margin = training.margin(budgets[rank])
        allowance = budgets[rank] - static - training.reserve - margin
        best = least = None
        for combo in itertools.product(*(by_stage[k][0] for k in mine)):
            memory = compose(order.actions[rank], {k: c.memory for k, c in zip(mine, combo)},
                             handoffs[rank])
            memory = with_fsdp(memory, [units[k] for k in mine if k in units],
                               training.data_parallel, handoffs[rank])
            cost = sum(c.recompute_flops for c in combo) * m
            if least is None or memory.peak < least[1].peak:
                least = (combo, memory)
            if memory.peak <= allowance and (best is None or (cost, memory.peak) < best[0]):
                best = ((cost, memory.peak), combo, memory)
        smallest[rank] = _smallest_budget(static + least[1].peak, training)
        if best is None:
            combo, memory = least
            raise _rank_error(rank, mine, budgets[rank], static, memory, training,
                              smallest[rank])
        _, combo, memory = best
        chosen.update(zip(mine, combo))
        ranks[rank], margins[rank] = memory, margin
        log.info("pipeline rank %d: stages %s, peak %s of %s", rank, mine,
                 format_size(static + memory.peak), format_size(budgets[rank]))
    return chosen, ranks, margins, smallest


def _smallest_budget(peak: int, training: Training) -> int:
    """The smallest whole-step budget whose reserve and margin leave `peak`."""
    need = peak + training.reserve
    budget = need + training.margin(need)
    while budget - training.margin(budget) < need:
        budget += 1
    while budget > need and budget - 1 - training.margin(budget - 1) >= need:
        budget -= 1
    return budget


def _rank_error(rank, stages, budget, static, memory, training: Training,
                smallest: int) -> BudgetError:
    need = static + memory.peak + training.reserve
    terms = {"what the rank holds anyway (state, receive buffers, batch)": static,
             "activations of the micro-batches in flight": memory.peak}
    dominant = max(terms, key=terms.get)
    remedy = ("more pipeline stages or ZeRO/FSDP within the stage"
              if dominant.startswith("what") else
              "fewer micro-batches in flight (a schedule that holds fewer, or more stages), "
              "smaller micro-batches")
    return BudgetError(
        f"pipeline rank {rank} (stages {stages}): no plan fits {format_size(budget)}; the "
        f"least it holds is {format_size(need)} ({static:,} B anyway, {memory.peak:,} B at "
        f"{memory.peak_action}), the smallest budget about {format_size(smallest)}; the "
        f"largest term: {dominant}: {remedy}", budget=budget, smallest=smallest,
        dominant=dominant, remedy=remedy)


def _warn_zbv_on_gloo(schedule: str) -> None:
    """torch before 2.13 fails its own ZBVZeroBubble over gloo in the first step's stage
    initialization ("Pair is not connected", a plain job without remat too; docs/
    limitations.md): the plan is sound, its run is not there. Said when planning, not found
    at the first step."""
    import warnings

    import torch
    import torch.distributed as dist

    from remat.fx_passes.tracing.torch_version import torch_at_least

    if (schedule == "ZBVZeroBubble" and not torch_at_least(2, 13) and dist.is_available()
            and dist.is_initialized() and dist.get_backend() == "gloo"):
        warnings.warn(f"torch {torch.__version__}'s ZBVZeroBubble fails over gloo in its first "
                      "step (\"Pair is not connected\", without remat too); run this plan on "
                      "torch 2.13 or later, or plan InterleavedZeroBubble", stacklevel=3)
