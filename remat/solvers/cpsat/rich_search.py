"""`optimal` over the richer execution model (`SolverOptions.model` "rich" or "auto").

Both start with the one-recomputation model (its own stages; `SINGLE_SHARE` of the limit under
"auto", `RICH_SINGLE_SHARE` under "rich"), whose plan the rich model starts from and which is
returned when the rich model cannot do better in the time left: a richer model never returns
less than the single one. Unless that plan meets a bound over the rich space already, a plan of
the rich space read off the relaxation with second runs where it peaks (`rich_relaxed`, in
RICH_PLAN_SHARE of the limit) replaces it where it costs less. Then a bound proven over the
rich space (`recompute_bound(rich=True)`); when the plan's cost meets it, that plan is the
rich optimum too and is returned; else the rest of the limit goes to the rich model
(`RichModel`, searched in `rich_model_search`), whose answer is taken only when it costs less
("auto" searches it only where the single plan is proven in its own space; "rich" always).
With a host link, the answer then goes through the offload search (`offload_search`:
keep in host memory what the plan recomputes, where the transfers hide), which scales where the
rich model is not built, in `OFFLOAD_SHARE` of the limit kept for it; its result is taken only
when it costs less. One deadline bounds the whole call. Statuses use only bounds valid over the
rich space: the rich bound, and CP-SAT's own bound on the rich model (which spans that space)
where it counts bytes exactly.
"""
from __future__ import annotations

import math
import time
from dataclasses import replace
from types import MappingProxyType
from typing import Callable

from remat.errors import BudgetError, SolverError
from remat.solvers.relaxation.bound import Bound, recompute_bound
from remat.solvers.cpsat.rich_model_search import rich_units, search_rich
from remat.solvers.cpsat.search import Progress, deadline_info
from remat.solvers.core.deadline import Deadline, modelled
from remat.solvers.cpsat.offload_search import improve_by_offload
from remat.solvers.core.options import SolverOptions
from remat.solvers.core.problem import Problem
from remat.solvers.relaxation.relaxed import binding_step, loaded_bound
from remat.solvers.relaxation.rich_relaxed import rich_relaxed_plan
from remat.solvers.core.schedule import Schedule, Status
from remat.solvers.timeline.evaluate import evaluate, make_schedule, price

# Shares of the time limit: the single model's whole call ("auto"; "rich", which wants the rich
# model searched, leaves it more time), the rich bound, the rich plan, and with a host link, the
# offload search's (taken from the single model's; the rich model's least-peak stage has its
# own, `rich_model_search.PEAK_STAGE_SHARE`). Under "auto" the single call has half: where it
# does not prove its plan in that, its CP-SAT search rarely moves it later, and the rich plan's
# bound needs the rest (mamba at 60 %: with 85 %, the search held 6.22e-05 for 7 s and the
# rich bound was cut at 4.66e-05).
SINGLE_SHARE = 0.5
RICH_SINGLE_SHARE = 0.5
BOUND_SHARE = 0.1
RICH_PLAN_SHARE = 0.1
# The rich bound's first solves (`loaded_bound`) have this share of its time.
LOADED_SHARE = 0.8
OFFLOAD_SHARE = 0.3
# Kept for finishing (evaluate, the true cost), in schedule evaluations.
FINISH_EVALUATIONS = 4
# Building the rich model takes about this many schedule evaluations (65 to 170 measured on
# synthetic transformers of 200 to 1,000 ops); it is built only within this share of the
# time left.
BUILD_EVALUATIONS = 200
BUILD_SHARE_OF_LEFT = 0.3


def full_cost(problem: Problem, schedule: Schedule) -> float:
    """The true cost of `schedule` on `problem`: every recomputation and every transfer."""
    return price(problem, schedule)[0]


def optimal_rich(problem: Problem, budget: int, options: SolverOptions, progress: Progress,
                 deadline: Deadline, single: Callable[[SolverOptions, Deadline], Schedule],
                 tolerance: float) -> Schedule:
    """`optimal` over the rich space (the module's stages): `single(options, part)` runs the
    single model's call in `part`; the result is OPTIMAL within `tolerance` of its bound."""
    call = _RichCall(problem, budget, options, progress, deadline, tolerance)
    call.run_single(single)
    call.measure_evaluation()
    return call.run()


class _RichCall:
    """One call of `optimal_rich`: the plan so far (`hint`, which `fits` the budget or not, and
    who made it, `fallback`), the bounds over the rich space, and the result's `info`."""

    def __init__(self, problem: Problem, budget: int, options: SolverOptions,
                 progress: Progress, deadline: Deadline, tolerance: float):
        self.problem, self.budget, self.options = problem, budget, options
        self.progress, self.deadline, self.tolerance = progress, deadline, tolerance
        self.start = time.perf_counter()
        self.limit = deadline.limit
        self.evaluation = modelled("evaluation", len(problem))  # measured, on the wall clock
        self.info: dict = {}
        self.hint: Schedule | None = options.hint
        self.below: BudgetError | None = None  # the single model's, where nothing of its space fits
        self.single_step_bound: float | None = None
        self.offload_time = OFFLOAD_SHARE * self.limit if problem.host_bandwidth else 0.0
        self.finish = 0.0  # kept for finishing (`measure_evaluation`)
        self.work = deadline  # the stages before the offload search (`measure_evaluation`)
        self.fits = False
        # Who made the plan when the hint stands: the single model, or the rich plan.
        self.fallback = "single"
        self.single_plan: Schedule | None = None  # where the single space binds: the rich bound's step

    def run_single(self, single: Callable[[SolverOptions, Deadline], Schedule]) -> None:
        """The single model first, in both: its plan is where the rich search starts, and what
        it returns when there is no time for the rich model (never less than the single
        model's)."""
        problem, info, limit = self.problem, self.info, self.limit
        share = SINGLE_SHARE if self.options.model == "auto" else RICH_SINGLE_SHARE
        share -= self.offload_time / limit if limit > 0 else 0.0
        try:  # the single model's call keeps its own time to finish
            hint = single(self.options, self.deadline.within(share * limit))
        except BudgetError as error:  # the rich space may fit below the single's least peak
            self.below = error
            hint = None
        else:
            info.update(single={"cost": hint.cost, "status": hint.status.value,
                                "bound": hint.bound},
                        **{k: v for k, v in hint.info.items() if k not in ("model",)})
            # One backward step's knapsack bounds every schedule of the rich space as well (a
            # value read after the step is held at it or made again after it, its inputs
            # likewise, each run costing at least once), but not where a value may instead
            # wait in host memory.
            if problem.host_bandwidth is None:
                self.single_step_bound = max(
                    hint.bound if hint.info.get("bound_steps") == 1 else 0.0,
                    hint.info.get("one_step_bound", 0.0))
        self.hint = hint
        self.fits = hint is not None and hint.peak <= self.budget
        self.single_plan = hint

    def measure_evaluation(self) -> None:
        """An evaluation's time (as modelled in deterministic mode, where it is charged), and
        from it the time kept for finishing; the stages before the offload search (`work`)
        end where its share begins."""
        deadline, problem = self.deadline, self.problem
        began = time.perf_counter()
        evaluate(problem, self.hint if self.hint is not None else make_schedule(problem, ()))
        measured = time.perf_counter() - began  # the wall clock's reserve: as measured
        if deadline.deterministic:
            deadline.charge(self.evaluation)
        else:
            self.evaluation = measured
        self.finish = FINISH_EVALUATIONS * max(self.evaluation, measured)
        self.work = (deadline.until(deadline.end - self.offload_time) if self.offload_time
                     else deadline).reserving(self.finish)

    def run(self) -> Schedule:
        """After the single model: the rich plan and the rich bound, then the rich model where
        they leave room; the result never costs more than the single model's plan."""
        info, hint = self.info, self.hint
        if self.fits and hint.cost == 0:  # nothing to gain: no schedule costs less than nothing
            info["rich_bound"] = 0.0
            return self.done(hint, 0.0, self.fallback)
        if self.options.model == "auto" and self.fits and hint.status is not Status.OPTIMAL:
            # The single model did not prove its plan in its share; the rich model, several
            # times its size, would do no better in what is left. Its status over the rich
            # space stands on the rich bound alone.
            info["rich"] = "not searched: the single model's plan is unproven in its own space"
        known = self.known_bound()
        if known is not None:
            return self.done(self.hint, known, self.fallback)
        self.read_rich_plan()
        rich = self.with_known_bounds(self.prove_rich_bound())
        info["rich_bound"] = rich.value
        if rich.value == math.inf and self.below is not None:
            raise self.below
        if rich.value == math.inf:
            raise BudgetError(f"no schedule fits the budget of {self.budget} bytes, even "
                              "recomputing values several times or offloading them (a single "
                              f"backward step holds more: {rich.where(self.problem)})",
                              budget=self.budget, smallest=None)
        if self.enough(rich.value):
            info["rich"] = "not searched: the plan meets the bound over the rich space"
            return self.done(self.hint, rich.value, self.fallback)
        if "rich" in info:
            return self.done(self.hint, rich.value, self.fallback)
        return self.search_rich_model(rich.value)

    def enough(self, value: float) -> bool:
        """Whether the plan fits and a bound of `value` proves it (`_close_enough`)."""
        return self.fits and _close_enough(self.hint.cost, value, self.options, self.tolerance)

    def known_bound(self) -> float | None:
        """The bound over the rich space that the single call proved, where the plan meets it.
        Its relaxation steps (proven over the rich space too, `optimal`'s driver) and its
        one-step bound already hold there: where the plan meets them within the relative gap,
        proving another would spend the rest of the limit for nothing (the 70B: 0.59 % at
        20 s, then 8 s more proving a rich bound it did not need). None: not met."""
        info, single_step = self.info, self.single_step_bound or 0.0
        known = max(info.get("rich_joint_bound", 0.0), single_step)
        if not (0 < known < math.inf and self.enough(known)):
            return None
        info["rich_bound"] = known
        joint = Bound(known, tuple(info.get("rich_joint_steps", ())), False)
        info["bound_from"] = ("one backward step (it holds over the rich space)"
                              if known == single_step else
                              f"backward steps over the rich space ({joint.where(self.problem)})")
        info["rich"] = "not searched: the plan meets the bound over the rich space"
        return known

    def read_rich_plan(self) -> None:
        """A plan of the rich space off the relaxation, with second runs where it peaks: it
        replaces the plan where it costs less (cheaper than the single optimum where a value
        recomputed for one reader is better run again than held to the next: mamba at 60 %)."""
        part = self.work.within(min(RICH_PLAN_SHARE * self.limit, self.work.left() / 2))
        plan = _rich_plan(self.problem, self.budget, self.hint, self.info, part, self.progress)
        if plan is not None and (not self.fits or plan.cost < self.hint.cost):
            self.hint, self.fits, self.fallback = plan, True, "rich"
            self.info["rich_plan"] = {"cost": plan.cost,
                                      "again": sum(map(len, plan.again.values()))}

    def prove_rich_bound(self) -> Bound:
        """A bound proven over the rich space, in its share of the limit, or more of what the
        single model left: all of it when the rich model will not be searched (the 7B at 1 %:
        the single model proves its plan in half the limit, and the pair of steps that bounds
        it over the rich space needs more than a tenth)."""
        problem, work, hint = self.problem, self.work, self.hint
        share = (work.left() if "rich" in self.info
                 else max(BOUND_SHARE * self.limit, work.left() / 2))
        part = work.within(share - 2 * self.evaluation)
        rich = Bound(0.0, (), False)
        if not part.check("proving a bound over the rich space"):
            return rich
        self.progress.update(stage="proving a bound over the rich space")
        part.charge(self.evaluation)
        # Where the single plan binds, even when the rich plan replaced it: mamba at 60 %, the
        # steps the bound joins from there (320) prove 4.98e-05, from the rich plan's (348)
        # 4.57e-05.
        binds = self.single_plan if self.single_plan is not None else hint
        steps = [b for b in [binding_step(problem, binds) if binds is not None else None]
                 if b is not None]
        # First the steps where the plan holds the most, joined: the runs it counts there
        # prove what recomputing twice costs (mamba at 60 %: 5.827e-05 for the rich plan's
        # 5.831e-05, where the steps below proved 4.98e-05).
        if hint is not None:
            rich = loaded_bound(problem, self.budget, hint,
                                part.within(LOADED_SHARE * part.left()), self.enough)
        if not self.enough(rich.value):
            found = recompute_bound(problem, self.budget, time_limit=part.limit, steps=steps,
                                    rich=True, deadline=part)
            rich = max(rich, found, key=lambda bound: bound.value)
        return rich

    def with_known_bounds(self, rich: Bound) -> Bound:
        """`rich`, or the single call's bounds that hold over the rich space where higher,
        with what `info` says of where the bound comes from."""
        info, single_step = self.info, self.single_step_bound
        # The single call's relaxation steps, proven over the rich space too (`optimal`'s
        # driver).
        joint = info.get("rich_joint_bound", 0.0)
        if joint > rich.value and joint > (single_step or 0.0):
            rich = Bound(joint, tuple(info.get("rich_joint_steps",
                                               info.get("relaxation_steps", ()))), False)
        if single_step is not None and single_step > rich.value:
            rich = replace(rich, value=single_step)
            info["rich_bound_from"] = "the single model's bound from one backward step"
            info["bound_from"] = "one backward step (it holds over the rich space)"
        elif rich.steps:
            info["bound_from"] = f"backward steps over the rich space ({rich.where(self.problem)})"
        return rich

    def search_rich_model(self, floor: float) -> Schedule:
        """The rich model, where its construction fits in its share of the time left, from the
        plan where it fits and above `floor`; its answer is taken only when it costs less."""
        problem, options, work = self.problem, self.options, self.work
        expected = modelled("rich model", len(problem)) if self.deadline.deterministic else (
            BUILD_EVALUATIONS * self.evaluation)
        if (expected > BUILD_SHARE_OF_LEFT * work.left()
                or not work.check("building the rich model")):
            return self.not_built(expected, floor)
        self.progress.update(stage="searching the rich model")
        units = rich_units(problem, options)
        found, searched = search_rich(problem, self.budget, options, units,
                                      self.hint if self.fits else None, work, floor,
                                      self.progress, self.info)
        return self.chosen(found, searched, max(floor, searched))

    def not_built(self, expected: float, bound: float) -> Schedule:
        """No time to build the rich model: the plan where it fits, else the error."""
        self.info["rich"] = f"not built: would take about {expected:.1f} s"
        self.work.stop("building the rich model", f"would take about {expected:.1f} s, "
                       f"{self.work.left():.1f} s left")
        if self.fits:
            return self.done(self.hint, bound, self.fallback)
        if self.below is not None:
            raise self.below
        raise SolverError(f"optimal: no time left to build the rich model (about {expected:.1f}"
                          " s) and the single model found no schedule that fits; raise "
                          "time_limit or the budget")

    def chosen(self, found: Schedule | None, searched: float, bound: float) -> Schedule:
        """The rich model's schedule where it costs less than the plan (or the plan alone
        fits); the errors where neither fits."""
        below, budget, hint, fits = self.below, self.budget, self.hint, self.fits
        if found is None and below is not None and not fits:
            if searched == math.inf:  # proven: nothing fits in the rich space either
                raise below
            raise BudgetError(f"{below} (nor did the rich model find a schedule in the time "
                              "left)", budget=budget, smallest=below.smallest,
                              dominant=below.dominant, remedy=below.remedy,
                              schedule=below.schedule, proven=below.proven)
        if searched == math.inf and not fits:
            raise BudgetError(f"no schedule fits the budget of {budget} bytes in the rich model "
                              f"(up to {self.options.max_copies} recomputations per value)",
                              budget=budget, smallest=None)
        if found is not None and (not fits or (found.cost, found.peak) < (hint.cost, hint.peak)):
            return self.done(found, bound, "rich")
        if fits:
            return self.done(hint, bound, self.fallback)
        raise SolverError(f"optimal: the rich model found no schedule within the time limit of "
                          f"{self.options.time_limit:g} s and the single model none that fits; "
                          "raise time_limit or the budget")

    def done(self, schedule: Schedule, bound: float, model: str) -> Schedule:
        """`schedule` (offloaded where it pays, with a host link) with its true status:
        OPTIMAL within the tolerance of `bound`."""
        problem = self.problem
        if problem.host_bandwidth:  # offload where it pays, at any size (offload_search)
            schedule = self.offloaded(schedule)
        self.progress.update(stage="done")
        cost = full_cost(problem, schedule)
        self.info["model"] = model
        self.info.update(deadline_info(self.deadline))
        # The single call's last resort (per-block checkpointing run past the deadline) stays
        # HEURISTIC unless proven; a plan that replaced it is not one.
        resort = schedule is self.single_plan and "last_resort" in self.info
        if not resort:
            self.info.pop("last_resort", None)
        return evaluate(problem, schedule, strategy="optimal", budget=self.budget, bound=bound,
                        status=(Status.OPTIMAL if cost - bound <= self.tolerance * cost
                                else Status.HEURISTIC if resort else Status.FEASIBLE),
                        solve_time=time.perf_counter() - self.start,
                        info=MappingProxyType(self.info))

    def offloaded(self, schedule: Schedule) -> Schedule:
        """The best of `schedule` and the fitting hint, each improved by the offload search
        in half the time left (less the finishing reserve)."""
        problem = self.problem
        self.progress.update(stage="offloading where the transfers hide")
        part = self.deadline.reserving(self.finish)
        starts = [schedule] + ([self.hint] if self.fits and self.hint is not schedule else [])
        best = schedule
        for k, start_from in enumerate(starts):
            if not part.check("offload search"):
                break
            part.charge(self.evaluation)
            improved = improve_by_offload(problem, self.budget, evaluate(problem, start_from),
                                          deadline=part.within(part.left() / (len(starts) - k)))
            if improved.cost < full_cost(problem, best):
                best = improved
        if best is not schedule:
            self.info["offload_search"] = best.info["offload_search"]
        return best


def _rich_plan(problem: Problem, budget: int, hint: Schedule | None, info: dict,
               part: Deadline, progress: Progress) -> Schedule | None:
    """`rich_relaxed_plan` from the steps the single call's relaxation joined (else the first
    backward step) and where `hint` binds, in `part`; None where none fits in time. (Mamba at
    60 %: the single call's three steps, and 320, where its plan binds: one solve, 0.1 s.)"""
    if not part.check("reading a rich plan off the relaxation"):
        return None
    progress.update(stage="reading a rich plan off the relaxation")
    binds = binding_step(problem, hint) if hint is not None else None
    steps = [*info.get("relaxation_steps", [problem.num_forward]),
             *([binds] if binds is not None else [])]
    plan = rich_relaxed_plan(problem, budget, steps, part)
    return plan if plan is not None and plan.peak <= budget else None


def _close_enough(cost: float, bound: float, options: SolverOptions, tolerance: float) -> bool:
    """Whether a plan of `cost` is proven optimal (within `tolerance`) or within the options'
    relative gap by `bound`."""
    return cost - bound <= tolerance * cost or (
        options.relative_gap > 0 and cost - bound <= options.relative_gap * cost)
