"""Exact eager plans: the cheapest per-block selective-checkpoint policy whose eager peak
(`remat.solvers.timeline.eager.eager_timeline`) fits the budget, solved with `EagerModel` and
reported like the compiled mode's plans: OPTIMAL within OPTIMAL_TOLERANCE of a proven bound, else
FEASIBLE with that bound and its gap.

First the model checked at a few slots (`slots`, SLOT_STAGE_SHARE of the least-cost
stage's time): its bound, and where its policy fits everywhere at that bound, the plan, which
the search over every slot then need not find; else the search starts from the best policy
found, with the bound as its floor.

One `Deadline` bounds the whole call (the caller's, or `options.time_limit` from the start):
the model's construction, the slot bound, the least-cost stage, the least-peak-at-that-cost
stage, and, where nothing fits, the least-peak search that BudgetError's smallest budget comes
from. The caller's hint (the heuristic `plan_eager`'s policy), else per-block checkpointing,
starts the search, and is returned where the search found nothing cheaper.
"""
from __future__ import annotations

import logging
import math
from dataclasses import replace
from types import MappingProxyType
from typing import Iterable

from ortools.sat.python import cp_model

from remat.errors import BudgetError, SolverError
from remat.solvers.eager.cp_run import eager_units, lp_first, run_model, solve_model
from remat.solvers.eager.least import least_eager_peak, too_small
from remat.solvers.eager.model import EagerModel
from remat.solvers.eager.slots import SlotBound, slot_bound
from remat.solvers.core.deadline import Deadline, OutOfTime
from remat.solvers.timeline.eager import eager_schedule
from remat.solvers.timeline.eager_blocks import EagerBlocks
from remat.solvers.eager.heuristic import plan_eager
from remat.solvers.core.objective import with_objective
from remat.solvers.core.options import SolverOptions
from remat.solvers.core.problem import Problem
from remat.solvers.core.schedule import OPTIMAL_TOLERANCE, Schedule, Status

log = logging.getLogger(__name__)

STRATEGY = "eager_optimal"
# The share of the time limit kept for lowering the peak at the least cost found.
PEAK_STAGE_SHARE = 0.1
# The share of the least-cost stage's time that the slot relaxation may take first
# (`slots`); where it proves its policy optimal, the search over every slot is skipped.
SLOT_STAGE_SHARE = 0.8
# The share of the slot stage's time left that repairing one relaxed policy may take.
REPAIR_SHARE = 0.7
# A CP-SAT solve of the whole model takes time to load it whatever its limit (DBRX: 0.6 s at a
# 1 ms limit under a load of 7, its Python build 4.5 s then): a stage starts only with at least
# this share of the model's build time left, which scales with the model and the load alike.
SOLVE_SETUP_SHARE = 0.25
# The model is built in two parts (`EagerModel(complete=False)`, then `complete`): what the slot
# stage reads, then the rows of the search over every slot, which takes about as long again
# (Gemma-2-9B: 2.7 s and 2.9 s under a load of 4; Phi-3-mini 0.9 s and 1.0 s). Until it is
# complete, the whole build is taken to be this many times the first part.
WHOLE_BUILD_FACTOR = 2.0
# The least-peak stage runs only with at least this many times the model's build time for it:
# its first seconds load the whole model, and with less it found nothing past the cost stage's
# policy (Gemma-2-9B's 14,276 ops under a load of 4: 9.7 s for a 6 s share, UNKNOWN; Phi-3-mini
# and Llama-3.2-1B on a quiet core, UNKNOWN in 2.4 s and 1.1 s).
PEAK_STAGE_BUILDS = 2.0
class _Disagreement(Exception):
    """The model's policy peaks above the budget on the eager timeline itself: the model and
    `eager_timeline` disagree on this problem (a bug of the model, never of the input)."""


def optimal_eager(problem: Problem, blocks: EagerBlocks, budget: int, options: SolverOptions,
                  *, hint: Iterable[int] | None = None, deadline: Deadline | None = None
                  ) -> Schedule:
    """`_optimal_eager`, guarded: where the exact model and the eager timeline disagree on a
    policy's peak, its claims prove nothing, so the hint's policy (the heuristic's, checked
    on the timeline) is returned FEASIBLE without a bound, and the result says why."""
    try:
        return _optimal_eager(problem, blocks, budget, options, hint=hint, deadline=deadline)
    except _Disagreement as e:
        start = None if hint is None else eager_schedule(problem, blocks, hint,
                                                         strategy=STRATEGY,
                                                         status=Status.FEASIBLE, budget=budget)
        if start is None or start.peak > budget:
            raise SolverError(f"{e}; no heuristic policy to fall back on: please report it") \
                from None
        log.warning("%s; returning the heuristic's policy, unproven", e)
        return replace(start, bound=None, info=MappingProxyType(
            {**start.info, "execution": "eager", "model": "eager heuristic",
             "exact_model": f"disagreed with the eager timeline ({e}); unproven"}))


def _optimal_eager(problem: Problem, blocks: EagerBlocks, budget: int, options: SolverOptions,
                   *, hint: Iterable[int] | None = None, deadline: Deadline | None = None
                   ) -> Schedule:
    """The least-cost policy (cached ops) whose eager peak fits `budget`, least peak among
    equals, as `eager_schedule`'s Schedule with status, bound and gap. `hint`: a policy's
    cached ops to start from. Raises BudgetError when no policy fits (proven, or the least
    peak found is above the budget: the message says which), per-block checkpointing's peak
    as found where the time allowed neither a policy that fits nor a proof."""
    options = options.by_size(len(problem))
    deadline = deadline or Deadline(options.time_limit)
    deadline.enter("eager: the model")
    return _EagerCall(problem, blocks, budget, options, hint, deadline).run()


class _EagerCall:
    """One call of `_optimal_eager`: the problem in the objective's costs, its units, the best
    policy known that fits (`start`), the model, and what the result reports (`info`)."""

    def __init__(self, problem: Problem, blocks: EagerBlocks, budget: int,
                 options: SolverOptions, hint: Iterable[int] | None, deadline: Deadline):
        self.problem, self.blocks, self.budget = problem, blocks, budget
        self.options, self.deadline = options, deadline
        self.costed = with_objective(problem, options.objective)
        self.units = eager_units(self.costed, blocks, options)
        self.info: dict = {"execution": "eager", "model": "eager", "bound_from": "CP-SAT search",
                           "objective": options.objective, "byte_unit": self.units.byte,
                           "exact": self.units.exact_rounding}
        start = None if hint is None else eager_schedule(self.costed, blocks, hint,
                                                         budget=budget)
        if start is not None and start.peak > budget:
            start = None  # a policy that does not fit starts nothing
        # Per-block checkpointing (every block checkpointed, caching nothing) is always a
        # candidate: where it fits and no policy given does, it starts the search, and is the
        # answer (HEURISTIC) where the time allows nothing better.
        per_block = eager_schedule(self.costed, blocks, (), budget=budget)
        self.resort = per_block if start is None and per_block.peak <= budget else None
        self.start: Schedule | None = start if start is not None else self.resort
        self.model: EagerModel | None = None
        self.setup = 0.0  # the least time a CP-SAT stage needs to load the model
        self.build_time = 0.0  # the model's construction (Python) time
        self.reserve = 0.0  # the time kept for the least-peak stage
        # The least-cost stage's answer: the policy, its cost in units and the bound proven.
        self.cached: frozenset[int] | None = None
        self.best, self.bound = 0, 0.0

    def run(self) -> Schedule:
        """The model, the slot bound (stage 0), the least cost (stage 1) unless the slots
        proved it, and the least peak at that cost (stage 2)."""
        if not self.build():
            return self.result(self.start, 0.0, "no time to build")
        model, capacity = self.model, self.units.capacity(self.budget)
        if model.fixed_peak > capacity:  # what no policy moves exceeds the budget already
            return self.least()
        self.capacity = capacity
        self.reserve = PEAK_STAGE_SHARE * self.deadline.limit
        relaxed = self.slot_stage(capacity)
        if relaxed is not None and math.isinf(relaxed.bound):  # no policy fits even at those slots
            return self.least()
        floor = 0.0 if relaxed is None else relaxed.bound
        if relaxed is not None and relaxed.cached is not None:
            found = eager_schedule(self.costed, self.blocks, relaxed.cached, budget=self.budget)
            if self.start is None or found.cost < self.start.cost:
                self.start = found
        ended = self.least_cost_stage(relaxed, floor)
        if ended is not None:
            return ended
        self.least_peak_stage()
        found = eager_schedule(self.costed, self.blocks, self.cached, budget=self.budget)
        if self.start is None or found.cost <= self.start.cost:
            self.start = found  # else CP-SAT's answer rounded cost away: the hint stays
        return self.result(self.start, self.bound, "searched")

    def build(self) -> bool:
        """Builds what the slot stage reads of the model where the deadline allows; the time
        it took sets `setup` and `build_time` (the whole build's, estimated)."""
        deadline = self.deadline
        if not deadline.check("eager: the model"):
            return False
        building = deadline.elapsed()
        try:
            self.model = EagerModel(self.costed, self.blocks, self.units, deadline,
                                    complete=False)
        except OutOfTime:
            return False
        self.build_time = WHOLE_BUILD_FACTOR * (deadline.elapsed() - building)
        self.setup = SOLVE_SETUP_SHARE * self.build_time
        self.info.update(cache_units=len(self.model.cache), slots=self.model.slots,
                         variables=len(self.model.model.Proto().variables))
        return True

    def complete(self) -> bool:
        """The whole model for a CP-SAT search over every slot: its remaining rows, the peak
        within the capacity, least cost its objective; the time it took corrects `setup` and
        `build_time`. False where the deadline passed first (the model is then not solved)."""
        model, deadline = self.model, self.deadline
        if model.completed:
            return True
        if self.info.get("completion") == "out of time":
            return False
        started = deadline.elapsed()
        try:
            model.complete(deadline)
        except OutOfTime:
            self.info["completion"] = "out of time"
            return False
        model.model.Add(model.peak <= self.capacity)
        model.model.Minimize(model.cost)
        self.build_time += deadline.elapsed() - started - self.build_time / WHOLE_BUILD_FACTOR
        self.setup = SOLVE_SETUP_SHARE * self.build_time
        return True

    def slot_stage(self, capacity: int) -> SlotBound | None:
        """Stage 0: the model checked at a few slots, grown where its policy overflows: a
        bound, and where its policy fits everywhere, the least-cost policy (`slots`).
        None where it does not run."""
        deadline, units = self.deadline, self.units
        part = deadline.within(SLOT_STAGE_SHARE * max(0.0, deadline.left() - self.reserve))
        # Its bound is the model's, which holds for exact bytes only; its first evaluations of
        # the model take about as long as loading it into CP-SAT (DBRX: 1 s under a load of 6).
        if not (units.exact_rounding and part.left() >= self.setup):
            return None
        deadline.enter("eager: slot bound")
        relaxed = slot_bound(self.model, capacity, self.options, part,
                             starts=() if self.start is None else [self.start.info["cached"]],
                             solve=lambda solver, cp, stage: run_model(lp_first(solver), cp, part,
                                                                  stage),
                             repair=lambda cached: self.repair(cached, part))
        self.info.update(slot_bound=relaxed.bound * units.cost + self.model.fixed_cost,
                         slots_checked=len(relaxed.slots), slot_rounds=relaxed.rounds)
        return relaxed

    def repair(self, cached, part: Deadline):
        """A relaxed policy that overflows, made to fit by the heuristic: what it and the
        best policy known both cache, improved (caching more while it fits), and the
        relaxed policy repaired (caching less until it fits), then improved."""
        known = frozenset(self.start.info["cached"]) if self.start is not None else frozenset()
        try:
            return plan_eager(self.costed, self.blocks, self.budget, [known & cached, cached],
                              part.within(REPAIR_SHARE * part.left())).info["cached"]
        except BudgetError:
            return None

    def least_cost_stage(self, relaxed: SlotBound | None, floor: float) -> Schedule | None:
        """Stage 1: least cost under the capacity, unless the slots proved it. Sets `cached`,
        `best` and `bound`; the result where the stage ends the call, else None."""
        model, units, deadline = self.model, self.units, self.deadline
        if relaxed is not None and relaxed.optimal:
            self.info.update(bound_from="slot bound", stage1_time=0.0)
            self.cached, self.best = relaxed.cached, model.units_cost(relaxed.cached)
            self.bound = floor * units.cost + model.fixed_cost
            return None
        if (deadline.left() - self.reserve < self.setup  # CP-SAT would only load the model
                or not self.complete()):
            deadline.stop("eager: least cost", "no time left to load the model")
            if floor > 0:
                self.info["bound_from"] = "slot bound"
            return self.result(self.start, floor * units.cost + model.fixed_cost,
                               "no time for the least-cost search")
        deadline.enter("eager: least cost")
        if floor > 0:  # the search stops where a policy meets it
            model.model.Add(model.cost >= math.ceil(floor - 1e-6))
        if self.start is not None:
            model.hint(self.start.info["cached"])
        status, solver = solve_model(model, self.options, deadline, deadline.left() - self.reserve,
                                "least cost")
        self.info["stage1_time"] = solver.WallTime()
        bound = solver.BestObjectiveBound() if units.exact_rounding else 0.0
        if floor > (bound if math.isfinite(bound) else 0.0):
            bound, self.info["bound_from"] = floor, "slot bound"
        self.bound = max(0.0, bound) * units.cost + model.fixed_cost if math.isfinite(bound) \
            else model.fixed_cost
        if status == cp_model.INFEASIBLE:
            return self.least()
        if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            return self.result(self.start, self.bound, solver.StatusName(status))
        self.cached = model.decision(solver.Value)
        self.best = round(solver.ObjectiveValue())
        return None

    def least_peak_stage(self) -> None:
        """Stage 2: least peak at the least cost found, where the time allows."""
        model, deadline = self.model, self.deadline
        seconds = min(deadline.left(), PEAK_STAGE_SHARE * deadline.limit)
        if deadline.left() <= max(0.05, self.setup):
            self.info["peak_stage"] = "skipped: no time left"
            return
        if seconds < PEAK_STAGE_BUILDS * self.build_time:
            self.info["peak_stage"] = (f"skipped: {seconds:.1f} s left for it, the model took "
                                       f"{self.build_time:.1f} s to build")
            return
        if not self.complete():
            self.info["peak_stage"] = "skipped: no time left to complete the model"
            return
        seconds = min(deadline.left(), seconds)
        deadline.enter("eager: least peak at that cost")
        model.model.Add(model.cost <= self.best)
        model.model.Minimize(model.peak)
        model.hint(self.cached)
        status2, solver = solve_model(model, self.options, deadline, seconds, "least peak")
        if status2 in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            self.cached = model.decision(solver.Value)
            self.info["peak_stage"] = "proven" if status2 == cp_model.OPTIMAL else "stopped"
        else:
            self.info["peak_stage"] = f"CP-SAT answered {solver.StatusName(status2)}"

    def result(self, schedule: Schedule | None, bound: float, how: str) -> Schedule:
        """`_result` for this call: per-block checkpointing's policy HEURISTIC, why in
        info["last_resort"], unless proven; no policy (none fits, nothing proven): BudgetError
        naming per-block checkpointing's peak as found."""
        if schedule is None:
            raise too_small(self.budget, eager_schedule(self.problem, self.blocks, ()), 0,
                             "checkpointing every block")
        found = _result(self.problem, self.blocks, schedule, bound, self.budget, self.deadline,
                        self.info, how)
        if schedule is not self.resort or how == "searched" or found.status is Status.OPTIMAL:
            return found
        log.warning("eager: no policy found within %.1f s (%s); returning per-block "
                    "checkpointing's", self.deadline.limit, how)
        return replace(found, status=Status.HEURISTIC, info=MappingProxyType(
            {**found.info, "last_resort": f"every block checkpointed, caching nothing: {how}"}))

    def least(self) -> Schedule:
        """`_least` for this call: where the model finds that nothing fits."""
        return _least(self.problem, self.blocks, self.budget, self.options, self.deadline,
                      self.info)


def _result(problem: Problem, blocks: EagerBlocks, schedule: Schedule, bound: float,
            budget: int, deadline: Deadline, info: dict, how: str) -> Schedule:
    """`schedule` (in the objective's costs) costed on `problem`, with its true status: OPTIMAL
    within OPTIMAL_TOLERANCE of `bound`, else FEASIBLE; the bound keeps the objective's gap."""
    cost = schedule.cost
    bound = min(bound, cost)
    optimum = cost - bound <= OPTIMAL_TOLERANCE * cost
    info.update(how=how, stages=deadline.stages, stopped=deadline.stopped)
    final = eager_schedule(problem, blocks, schedule.info["cached"], strategy=STRATEGY,
                           status=Status.OPTIMAL if optimum else Status.FEASIBLE, budget=budget)
    scaled = bound / cost * final.cost if cost > 0 else 0.0
    if final.peak > budget:  # the model is exact or conservative: this is a bug
        raise _Disagreement(f"eager: the exact model's policy peaks at {final.peak:,} bytes on "
                            f"the eager timeline, above the budget of {budget:,}")
    return replace(final, bound=scaled, solve_time=deadline.elapsed(),
                   info=MappingProxyType({**final.info, **info,
                                          "objective_cost": cost, "objective_bound": bound}))


def _least(problem: Problem, blocks: EagerBlocks, budget: int, options: SolverOptions,
           deadline: Deadline, info: dict) -> Schedule:
    """Where the model finds that nothing fits: the policy of least peak, which fits only where
    the model's units made it conservative; else BudgetError naming that peak, and whether it
    is proven the least."""
    least, floor = least_eager_peak(problem, blocks, options, deadline=deadline)
    if least.peak <= budget:
        return _result(problem, blocks, least, 0.0, budget, deadline, info, "least peak")
    raise too_small(budget, least, floor, "the least-peak search")

