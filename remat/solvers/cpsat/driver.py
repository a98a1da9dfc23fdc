"""Strategy `optimal`: the search driver. One deadline (`remat.solvers.core.deadline.Deadline`,
`options.time_limit` from the call's start) bounds everything it runs, in this order: the hint
pool's baselines, the plan read off the bound's relaxation (`remat.solvers.relaxation.relaxed`,
which proves a bound too), the least-peak search where nothing fits, the drop pass, the bound at the
step where the hint binds, the model's construction, the least-cost stage, the
least-peak-at-that-cost stage, and every fallback (a baseline skipped for time runs in what the
later stages left). Each part gets a share of the limit, never more than what is left less the time
kept to finish; each checks the deadline between its steps (a model's construction too) and every
CP-SAT solve runs under its watchdog. What could not run is named in `info` ("skipped",
"model_build", "peak_stage", "stopped_in"). In deterministic mode (`SolverOptions.deterministic`)
the shares are of deterministic time: the same decisions in any process (`search.deadline_of`).

The status is the truth about the returned schedule's true (unrounded) cost: OPTIMAL only when
it is within OPTIMAL_TOLERANCE of a proven bound; else FEASIBLE, with that bound and its gap.
"""
from __future__ import annotations

import logging
import math
import time

from ortools.sat.python import cp_model

from remat.solvers.relaxation.bound import Bound, recompute_bound
from remat.solvers.cpsat.call_outcomes import CallOutcomes
from remat.solvers.cpsat.hints import Pool, drop_pass
from remat.solvers.cpsat.rich_search import optimal_rich
from remat.solvers.cpsat.search import (Progress, Trace, build_model, cp_solver, deadline_of,
                                        run_solver)
from remat.solvers.cpsat.units import Units
from remat.solvers.core.deadline import Deadline, OutOfTime, modelled
from remat.solvers.core.options import SolverOptions
from remat.solvers.core.problem import Problem
from remat.solvers.relaxation.relaxed import binding_step, relaxed_schedule
from remat.solvers.core.schedule import OPTIMAL_TOLERANCE, Schedule
from remat.solvers.timeline.evaluate import evaluate, make_schedule

logger = logging.getLogger(__name__)

# Shares of the time limit (the relaxations of remat.solvers.relaxation.bound run with their own
# worker count, bound.WORKERS, whatever `options.workers` gives the search): the hint pool's
# baselines; the plan read off the relaxation; the drop pass; the least-peak search when no baseline
# fits (of what is left; it stops once the budget is met); the bound proven from backward steps;
# the stage that lowers the peak at the found cost.
BASELINE_SHARE = 0.25
UNTIL_ONE_FITS_SHARE = 0.4  # the pool's while none of it fits yet
RELAXED_SHARE = 0.55
HINT_SHARE = 0.05
LEAST_PEAK_SHARE = 0.5
BOUND_SHARE = 0.15
PEAK_STAGE_SHARE = 0.1
RICH_JOINT_SHARE = 0.35  # more for the relaxation, whose joint steps prove the rich bound
# Building the model, and finishing, in schedule evaluations: what they took at 10,000 ops on
# a loaded machine (build 13 to 41 evaluations, finish 3).
BUILD_EVALUATIONS = 40
FINISH_EVALUATIONS = 4
# What a relaxation's part (its build, its plans' evaluations) runs past its solve's time limit.
PART_EVALUATIONS = 3


def optimal(problem: Problem, budget: int, options: SolverOptions) -> Schedule:
    """The least-recompute-cost schedule whose simulated peak fits `budget`, least peak among
    equals; OPTIMAL when proven, else FEASIBLE with the best bound (time limit, relative gap).
    Raises BudgetError when no schedule fits (or none was found and the least peak found is
    above the budget: the message says which and whether it is proven). Where the time allowed
    no plan that fits, per-block checkpointing is the answer where it fits (HEURISTIC, the
    reason in info["last_resort"]; `CallOutcomes.nothing_found`)."""
    options = options.by_size(len(problem))
    deadline = deadline_of(options)
    with Progress(deadline) as progress:
        # Just-in-time positions are the single model's space (the rich model's are free).
        if options.model == "single" or (options.model == "auto" and not options.free_positions):
            return _Call(problem, budget, options, progress, deadline).run()
        # The richer model ("rich"), or the single model first and the richer one where a
        # bound over its space leaves room ("auto"): `remat.solvers.cpsat.rich_search`.
        return optimal_rich(
            problem, budget, options, progress, deadline,
            lambda first, part: _Call(problem, budget, first, progress, part).run(),
            OPTIMAL_TOLERANCE)


class _Call(CallOutcomes):
    """One call of `optimal` (or its single-model part): deadline, shared state, stages."""

    def __init__(self, problem: Problem, budget: int, options: SolverOptions, progress: Progress,
                 deadline: Deadline):
        self.problem, self.budget, self.options, self.progress = problem, budget, options, progress
        self.deadline, self.limit = deadline, deadline.limit
        self.start = time.perf_counter()  # the anytime trace's times are wall seconds from here
        self.units = Units.of(problem, options)
        self.pool = Pool(problem, options)
        self.least: Schedule | None = None
        self.least_proven = False
        self.lowest: list[Schedule] = []  # the relaxation's plan of least peak, fitting or not
        self.info: dict = {"byte_unit": self.units.byte, "cost_unit": self.units.cost,
                           "exact": self.units.exact_bytes, "model": "single"}

    def work(self) -> Deadline:
        """The deadline less the time kept for finishing (FINISH_EVALUATIONS evaluations)."""
        return self.deadline.reserving(self.finish())

    def part(self, fraction: float, less: float = 0.0) -> Deadline:
        """A stage's part: `fraction` of the limit from now less `less` seconds, never past the
        call's end less the time kept for finishing."""
        return self.work().within(fraction * self.limit - less)

    def run(self) -> Schedule:
        """The stages in order: the hint (baselines, the relaxation's plan, the least peak
        where nothing fits, the drop pass), a bound where it binds, the model, the least cost
        and the least peak at that cost."""
        hint = self.baseline_hint()
        relaxed, relaxed_bound = self.read_relaxation()
        if relaxed is not None and (hint is None or relaxed.cost < hint.cost):
            hint = relaxed
        self.progress.update(cost=hint.cost if hint is not None else None,
                             bound=relaxed_bound.value)
        if relaxed_bound.value == math.inf:  # proven: no schedule fits
            return self.fail(model=None)
        model = None
        if hint is None:
            # Near the smallest peak no baseline fits, and CP-SAT rarely finds a first schedule:
            # the least-peak search does (or proves that none fits).
            model = self.build()
            if model is None:
                return self.without_model(None, relaxed_bound, must_fit=True)
            if model.fixed_peak > self.units.capacity(self.budget):
                return self.fail(model)
            hint = self.least_peak_hint(model)
        if self.pool.skipped:
            self.info["skipped"] = dict(self.pool.skipped)
        if hint is not None:
            hint = self.drop_recomputations(hint)
        step_bound = self.prove_step_bound(hint, relaxed_bound)
        if step_bound.value == math.inf:  # no schedule fits: find the least peak for the error
            return self.fail(model)
        if self.close_enough(hint, step_bound.value):
            # The relaxation's plan is often proven this close already (7B: 0.1 % at 2.8 s);
            # the search would spend the rest of the limit not improving it.
            self.info["stopped"] = (f"the hint is proven within relative_gap "
                                    f"{self.options.relative_gap:g} before the search")
            return self.result(hint, self.best_bound(0.0, step_bound))
        if model is None:
            model = self.build()
            if model is None:  # no time to search: the hint as it is, with what is proven
                return self.without_model(hint, step_bound, must_fit=False)
        if model.fixed_peak > self.units.capacity(self.budget):
            return self.fail(model)
        self.start_from_bound(model, step_bound)
        return self.least_cost(model, hint, step_bound)

    def baseline_hint(self) -> Schedule | None:
        """The hint: the caller's, else the pool's best (None: none ran in time)."""
        self.progress.update(stage="running the baselines")
        hint = self.options.hint
        if hint is not None:
            began = time.perf_counter()
            hint = evaluate(self.problem, hint)
            self.pool.seconds_per_evaluation = time.perf_counter() - began
            self.deadline.charge(modelled("evaluation", len(self.problem)))
        if hint is None or hint.peak > self.budget:
            hint = self.pool.best(self.budget, self.part(BASELINE_SHARE),
                                  until_one_fits=self.part(UNTIL_ONE_FITS_SHARE))
        return hint

    def read_relaxation(self) -> tuple[Schedule | None, Bound]:
        """The plan a backward step's relaxation suggests, repaired to fit (None: none), and
        the bound its solves prove: far cheaper than any baseline's on stacks of blocks, and
        sometimes the only plan that fits."""
        relaxed, relaxed_bound = None, Bound(0.0, (), True)
        # Under "auto" and "rich" the call's bound is over the rich space: the steps joined are
        # proven over it in this stage (`rich`), which has RICH_JOINT_SHARE more time for them.
        rich = [] if self.rich_bound_wanted() else None
        plans = self.part(RELAXED_SHARE, PART_EVALUATIONS * self.evaluation())
        part = self.part(RELAXED_SHARE + RICH_JOINT_SHARE * (rich is not None),
                         PART_EVALUATIONS * self.evaluation())
        if not part.check("reading a plan off the relaxation"):
            self.info["relaxation"] = "skipped: no time left"
            return relaxed, relaxed_bound
        self.progress.update(stage="reading a plan off the relaxation")
        one_step: list[Bound] = []
        relaxed, relaxed_bound = relaxed_schedule(
            self.problem, self.budget, time_limit=part.limit, lowest=self.lowest, deadline=part,
            one_step=one_step, rich=rich, plans=plans,
            relative_gap=max(self.options.relative_gap, OPTIMAL_TOLERANCE))
        if one_step and math.isfinite(one_step[0].value):  # for the rich space's bound
            self.info["one_step_bound"] = one_step[0].value
        if rich and rich[0].value > 0:
            self.info["rich_joint_bound"] = rich[0].value
            self.info["rich_joint_steps"] = rich[0].steps
        if len(relaxed_bound.steps) > 1:
            self.info["relaxation_steps"] = relaxed_bound.steps
        return relaxed, relaxed_bound

    def least_peak_hint(self, model) -> Schedule | None:
        """Where no plan is known: the least-peak search's schedule where it fits (None where
        it found none that does, unproven); BudgetError where it proves that none fits."""
        work = self.work()
        self.search_least_peak(model, work.within(LEAST_PEAK_SHARE * work.left()),
                               target=self.units.capacity(self.budget))
        if self.least is not None and self.least.peak <= self.budget:
            return self.least
        if self.least is not None and self.least_proven:
            raise self.too_small()
        return None

    def drop_recomputations(self, hint: Schedule) -> Schedule:
        """The hint less what it recomputes that fitting does not need, in HINT_SHARE. The
        relaxation's plan too recomputes more than fitting needs (gpt2 at half its save-all
        peak: 0.118 ms, 0.090 ms after the drop pass in 0.5 s)."""
        part = self.part(HINT_SHARE, self.evaluation())
        self.progress.update(cost=hint.cost)
        if part.check("improving the hint"):
            self.progress.update(stage="improving the hint")
            hint = drop_pass(self.problem, self.budget, hint, part)
        self.info["hint"] = hint.strategy
        return hint

    def prove_step_bound(self, hint: Schedule | None, relaxed_bound: Bound) -> Bound:
        """A bound proven at the step where the hint peaks, where the budget binds, unless
        the relaxation's solves proved one there already (or one over several steps)."""
        step_bound = relaxed_bound
        part = self.part(BOUND_SHARE, (1 + PART_EVALUATIONS) * self.evaluation())
        if len(relaxed_bound.steps) < 2 and part.check("proving a bound"):
            self.deadline.charge(modelled("evaluation", len(self.problem)))
            binding = binding_step(self.problem, hint) if hint is not None else None
            if binding not in relaxed_bound.steps:
                self.progress.update(stage="proving a bound")
                found = recompute_bound(self.problem, self.budget, time_limit=part.limit,
                                        deadline=part,
                                        steps=[binding] if binding is not None else [])
                step_bound = max(found, relaxed_bound, key=lambda bound: bound.value)
        return step_bound

    def without_model(self, hint: Schedule | None, bound: Bound, must_fit: bool) -> Schedule:
        """Where the model could not be built in time: the hint, or a baseline skipped before
        (`second_chance`), with what is proven. A short limit on a loaded machine (a call
        whose capture took most of it) may have skipped every baseline: those that fit beat
        no plan at all, and per-block checkpointing, run past the deadline, beats an error
        (`nothing_found`). `must_fit`: a schedule above the budget is no answer."""
        hint = self.second_chance(hint)
        if hint is None or (must_fit and hint.peak > self.budget):
            return self.nothing_found("no time left to build the model",
                                      self.best_bound(0.0, bound))
        self.info["from_hint"] = True
        return self.result(hint, self.best_bound(0.0, bound))

    def start_from_bound(self, model, step_bound: Bound) -> None:
        """Tells the model the bound proven from backward steps: CP-SAT's own bound starts
        there."""
        if step_bound.steps:
            self.info.update(step_bound=step_bound.value,
                             step_bound_at=step_bound.where(self.problem))
            self.progress.update(bound=step_bound.value)
            # Each op's cost rounds down by less than a unit, so the model's cost of any
            # schedule is at least this.
            model.model.Add(model.cost >= math.floor(step_bound.value / self.units.cost)
                            - len(model.rec))

    def least_cost(self, model, hint: Schedule | None, step_bound: Bound) -> Schedule:
        """Stage 1: least recompute cost under the capacity (budget rounded DOWN to units),
        then the least peak at that cost (stage 2), and the schedule."""
        units, m = self.units, model.model
        self.progress.update(stage="searching for the least cost")
        m.Add(model.peak <= units.capacity(self.budget))
        m.Minimize(model.cost)
        if hint is not None:
            model.hint(hint)
        trace = Trace(units, self.start, self.options.on_solution, self.progress,
                      enough=step_bound.value / (1 - OPTIMAL_TOLERANCE), slack=len(model.rec))
        work = self.work()
        reserve = (PEAK_STAGE_SHARE * self.limit if hint is None or hint.recomputed else 0.0)
        solver = cp_solver(self.options, work, work.left() - reserve, self.progress, units)
        status = run_solver(solver, m, work, "searching for the least cost", trace)
        self.info.update(stage1_time=solver.WallTime(), trace=trace.trace)
        searched = solver.BestObjectiveBound() * units.cost
        # CP-SAT's bound holds for the true problem only where the model's bytes are exact.
        bound = self.best_bound(searched if model.exact and math.isfinite(searched) else 0.0,
                                step_bound)
        if status == cp_model.INFEASIBLE:
            return self.fail(model)
        if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            return self.unsearched(hint, bound, solver.StatusName(status))
        best_cost = round(solver.ObjectiveValue())
        recomputed, positions = model.decision(solver.Value)
        recomputed, positions = self.lower_peak(model, best_cost, recomputed, positions,
                                                solver.Value(model.peak))
        self.progress.update(stage="finishing")
        schedule = make_schedule(self.problem, recomputed, recompute_at=positions)
        if hint is not None and hint.peak <= self.budget and hint.cost < schedule.cost:
            schedule = hint  # CP-SAT started from it; its own answer can only be as good
        return self.result(schedule, bound)

    def unsearched(self, hint: Schedule | None, bound: float, status: str) -> Schedule:
        """Out of time before CP-SAT accepted any schedule: the hint (or a baseline skipped
        before) where it fits (simulated); a caller's hint need not. Else `nothing_found`."""
        hint = self.second_chance(hint)
        if hint is not None and hint.peak <= self.budget:
            self.info["from_hint"] = True
            found = self.result(hint, bound)
            # The hint's status is its own: OPTIMAL where the bound proves its cost least.
            logger.warning("optimal: CP-SAT found no schedule within %.1f s; returning the "
                           "hint (%s), %s", self.limit, hint.strategy, found.status.value)
            return found
        return self.nothing_found(f"CP-SAT found no schedule in the time ({status})", bound)

    def lower_peak(self, model, best_cost: int, recomputed, positions, model_peak: int):
        """Stage 2: least peak at the least cost (keeps the live-range ends tight, too): the
        decision, the first stage's where this one does not run or finds nothing. Bounded by
        its share; pointless when nothing is recomputed (the peak is then fixed)."""
        info = self.info
        part = self.part(PEAK_STAGE_SHARE, self.evaluation())
        if not recomputed:
            info["peak_stage"] = "skipped: nothing is recomputed"
            return recomputed, positions
        if not part.check("lowering the peak at that cost") or part.left() <= 0.05:
            info["peak_stage"] = "skipped: no time left"
            return recomputed, positions
        self.progress.update(stage="lowering the peak at that cost")
        self.deadline.charge(modelled("evaluation", len(self.problem)))
        first = make_schedule(self.problem, recomputed, recompute_at=positions)
        self.progress.update(stage="lowering the peak: solving")
        m = model.model
        m.Add(model.cost <= best_cost)
        m.Minimize(model.peak)
        m.ClearHints()  # the first stage's hint would stand beside this one's
        model.hint(first)
        solver = cp_solver(self.options, part)
        status = run_solver(solver, m, part, "lowering the peak: solving")
        if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            recomputed, positions = model.decision(solver.Value)
            model_peak = solver.Value(model.peak)
            info["peak_proven"] = status == cp_model.OPTIMAL and model.exact
            info["peak_stage"] = "proven" if info["peak_proven"] else "stopped at its share"
        else:  # the first stage's answer stands; its live-range ends need not be tight
            info["peak_stage"] = f"CP-SAT answered {solver.StatusName(status)}"
        info["model_peak"] = model_peak * self.units.byte
        return recomputed, positions

    def rich_bound_wanted(self) -> bool:
        """Whether the call's bound must hold over the rich space ("auto", "rich")."""
        return self.options.model != "single" and self.options.free_positions

    def evaluation(self) -> float:
        """Seconds one schedule evaluation takes: measured, or modelled (deterministic mode)."""
        return self.pool.evaluation(self.deadline.deterministic)

    def finish(self) -> float:
        """Seconds to keep for turning the search's answer into a schedule (a few
        evaluations: make_schedule, the hint, evaluate), on the wall clock: an evaluation as
        measured, where that is longer than modelled (a loaded machine)."""
        measured = self.pool.seconds_per_evaluation or 0.0
        return FINISH_EVALUATIONS * max(self.evaluation(), measured)

    def build(self):
        """The model for the options, when its construction (predicted from an evaluation's
        time) fits in the time left and ends before the deadline; else None."""
        expected = BUILD_EVALUATIONS * self.evaluation()
        work = self.work()
        if expected > work.left() or not work.check("building the model"):
            self.info["model_build"] = f"not built: would take about {expected:.1f} s"
            work.stop("building the model", f"would take about {expected:.1f} s, "
                      f"{work.left():.1f} s left")
            return None
        self.progress.update(stage="building the model")
        began = time.perf_counter()
        self.deadline.charge(modelled("model", len(self.problem)))
        try:
            model = build_model(self.problem, self.units, self.options, work)
        except OutOfTime:
            self.info["model_build"] = "stopped at the deadline"
            return None
        self.info.update(variables=len(model.model.Proto().variables),
                         build_time=time.perf_counter() - began, exact=model.exact)
        return model

    def second_chance(self, hint: Schedule | None) -> Schedule | None:
        """`hint`, or a baseline the pool had no time for that does better in the time left
        (`Pool.second_chance`): where the relaxation and the model could not run. Where none
        fits, `nothing_found` runs the last resort past the deadline."""
        if self.pool.skipped:
            work = self.work()
            if work.left() > 0:  # else none runs in time
                self.progress.update(stage="running the baselines skipped")
            hint = self.pool.second_chance(hint, self.budget, work)
            self.info.update(skipped=dict(self.pool.skipped),
                             **({"hint": hint.strategy} if hint is not None else {}))
        return hint

