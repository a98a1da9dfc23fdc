"""`optimal` over the richer execution model (`SolverOptions.model` "rich" or "auto").

Both start with the one-recomputation model (its own stages; `SINGLE_SHARE` of the limit under
"auto", `RICH_SINGLE_SHARE` under "rich"), whose plan the rich model starts from and which is
returned when the rich model cannot do better in the time left: a richer model never returns
less than the single one. Unless that plan meets a bound over the rich space already, a plan of
the rich space read off the relaxation with second runs where it peaks (`rich_relaxed`, in
RICH_PLAN_SHARE of the limit) replaces it where it costs less. Then a bound proven over the
rich space (`recompute_bound(rich=True)`); when the plan's cost meets it, that plan is the
rich optimum too and is returned; else the rest of the limit goes to the rich model
(`RichModel`), whose answer is taken only when it costs less ("auto" searches it only where the single plan is proven in its own space; "rich"
always). With a host link, the answer then goes through the offload search (`offload_search`:
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

from ortools.sat.python import cp_model

from remat.errors import BudgetError, SolverError
from remat.solvers.relaxation.bound import Bound, recompute_bound
from remat.solvers.cpsat.rich_model import RichModel
from remat.solvers.cpsat.search import Progress, Trace, cp_solver, deadline_info, run_solver
from remat.solvers.cpsat.units import Units
from remat.solvers.core.deadline import Deadline, OutOfTime, modelled
from remat.solvers.cpsat.offload_search import improve_by_offload
from remat.solvers.core.options import SolverOptions
from remat.solvers.core.problem import Problem
from remat.solvers.relaxation.relaxed import binding_step, loaded_bound
from remat.solvers.relaxation.rich_relaxed import rich_relaxed_plan
from remat.solvers.core.schedule import Schedule, Status

# Shares of the time limit: the single model's whole call ("auto"; "rich", which wants the rich
from remat.solvers.timeline.evaluate import evaluate, make_schedule, price
# model searched, leaves it more time), the rich bound, the rich model's least-peak stage, and
# with a host link, the offload search's (taken from the single model's). Under "auto" the
# single call has half: where it does not prove its plan in that, its CP-SAT search rarely
# moves it later, and the rich plan's bound needs the rest (mamba at 60 %: with 85 %, the
# search held 6.22e-05 for 7 s and the rich bound was cut at 4.66e-05).
SINGLE_SHARE = 0.5
RICH_SINGLE_SHARE = 0.5
BOUND_SHARE = 0.1
RICH_PLAN_SHARE = 0.1
# The rich bound's first solves (`loaded_bound`) have this share of its time.
LOADED_SHARE = 0.8
PEAK_STAGE_SHARE = 0.1
OFFLOAD_SHARE = 0.3
# Kept for finishing (evaluate, the true cost), in schedule evaluations.
FINISH_EVALUATIONS = 4
# Building the rich model takes about this many schedule evaluations (65 to 170 measured on
# synthetic transformers of 200 to 1,000 ops); it is built only within this share of the
# time left.
BUILD_EVALUATIONS = 200
BUILD_SHARE_OF_LEFT = 0.3
MAX_RICH_COST_UNITS = 2 ** 28


def full_cost(problem: Problem, schedule: Schedule) -> float:
    """The true cost of `schedule` on `problem`: every recomputation and every transfer."""
    return price(problem, schedule)[0]


def optimal_rich(problem: Problem, budget: int, options: SolverOptions, progress: Progress,
                 deadline: Deadline, single: Callable[[SolverOptions, Deadline], Schedule],
                 tolerance: float) -> Schedule:
    start = time.perf_counter()
    limit = deadline.limit
    evaluation = modelled("evaluation", len(problem))  # measured below, on the wall clock
    info: dict = {}
    hint = options.hint
    below: BudgetError | None = None  # the single model's, where nothing of its space fits
    single_step_bound: float | None = None
    # The single model first, in both: its plan is where the rich search starts, and what it
    # returns when there is no time for the rich model (never less than the single model's).
    share = SINGLE_SHARE if options.model == "auto" else RICH_SINGLE_SHARE
    offload_time = OFFLOAD_SHARE * limit if problem.host_bandwidth else 0.0
    share -= offload_time / limit if limit > 0 else 0.0
    try:  # the single model's call keeps its own time to finish
        hint = single(options, deadline.within(share * limit))
    except BudgetError as error:  # the rich space may fit below the single's least peak
        below = error
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
            single_step_bound = max(hint.bound if hint.info.get("bound_steps") == 1 else 0.0,
                                    hint.info.get("one_step_bound", 0.0))
    began = time.perf_counter()
    evaluate(problem, hint if hint is not None else make_schedule(problem, ()))
    measured = time.perf_counter() - began  # the wall clock's reserve: as measured
    if deadline.deterministic:
        deadline.charge(evaluation)
    else:
        evaluation = measured
    finish = FINISH_EVALUATIONS * max(evaluation, measured)
    # The stages before the offload search (`done`) end where its share begins.
    work = (deadline.until(deadline.end - offload_time) if offload_time
            else deadline).reserving(finish)
    fits = hint is not None and hint.peak <= budget
    # Who made the plan when the hint stands: the single model, or the rich plan below.
    fallback = "single"
    single_unproven = fits and hint.status is not Status.OPTIMAL
    single_plan = hint  # where the single space binds: the rich bound's step (below)

    def done(schedule: Schedule, bound: float, model: str) -> Schedule:
        if problem.host_bandwidth:  # offload where it pays, at any size (offload_search)
            schedule = offloaded(schedule)
        progress.update(stage="done")
        cost = full_cost(problem, schedule)
        info["model"] = model
        info.update(deadline_info(deadline))
        return evaluate(problem, schedule, strategy="optimal", budget=budget, bound=bound,
                        status=(Status.OPTIMAL if cost - bound <= tolerance * cost
                                else Status.FEASIBLE),
                        solve_time=time.perf_counter() - start, info=MappingProxyType(info))

    def offloaded(schedule: Schedule) -> Schedule:
        """The best of `schedule` and the fitting hint, each improved by the offload search
        in half the time left (less the finishing reserve)."""
        progress.update(stage="offloading where the transfers hide")
        part = deadline.reserving(finish)
        starts = [schedule] + ([hint] if fits and hint is not schedule else [])
        best = schedule
        for k, start_from in enumerate(starts):
            if not part.check("offload search"):
                break
            part.charge(evaluation)
            improved = improve_by_offload(problem, budget, evaluate(problem, start_from),
                                          deadline=part.within(part.left() / (len(starts) - k)))
            if improved.cost < full_cost(problem, best):
                best = improved
        if best is not schedule:
            info["offload_search"] = best.info["offload_search"]
        return best

    if fits and hint.cost == 0:  # nothing to gain: no schedule costs less than nothing
        info["rich_bound"] = 0.0
        return done(hint, 0.0, fallback)
    if options.model == "auto" and single_unproven:
        # The single model did not prove its plan in its share; the rich model, several times
        # its size, would do no better in what is left. Its status over the rich space stands
        # on the rich bound alone.
        info["rich"] = "not searched: the single model's plan is unproven in its own space"
    # The single call's relaxation steps (proven over the rich space too, `optimal`'s driver)
    # and its one-step bound already hold over the rich space: where the plan meets them within
    # the relative gap, proving another would spend the rest of the limit for nothing (the 70B:
    # 0.59 % at 20 s, then 8 s more proving a rich bound it did not need).
    known = max(info.get("rich_joint_bound", 0.0), single_step_bound or 0.0)
    if fits and 0 < known < math.inf and _close_enough(hint.cost, known, options, tolerance):
        info["rich_bound"] = known
        joint = Bound(known, tuple(info.get("rich_joint_steps", ())), False)
        info["bound_from"] = ("one backward step (it holds over the rich space)"
                              if known == (single_step_bound or 0.0) else
                              f"backward steps over the rich space ({joint.where(problem)})")
        info["rich"] = "not searched: the plan meets the bound over the rich space"
        return done(hint, known, fallback)
    # A plan of the rich space off the relaxation, with second runs where it peaks: cheaper
    # than the single optimum where a value recomputed for one reader is better run again than
    # held to the next (mamba at 60 %).
    part = work.within(min(RICH_PLAN_SHARE * limit, work.left() / 2))
    plan = _rich_plan(problem, budget, hint, info, part, progress)
    if plan is not None and (not fits or plan.cost < hint.cost):
        hint, fits, fallback = plan, True, "rich"
        info["rich_plan"] = {"cost": plan.cost, "again": sum(map(len, plan.again.values()))}
    # Its share of the limit, or more of what the single model left: all of it when the rich
    # model will not be searched (the 7B at 1 %: the single model proves its plan in half the
    # limit, and the pair of steps that bounds it over the rich space needs more than a tenth).
    share = work.left() if "rich" in info else max(BOUND_SHARE * limit, work.left() / 2)
    part = work.within(share - 2 * evaluation)
    rich = Bound(0.0, (), False)
    if part.check("proving a bound over the rich space"):
        progress.update(stage="proving a bound over the rich space")
        part.charge(evaluation)
        # Where the single plan binds, even when the rich plan replaced it: mamba at 60 %, the
        # steps the bound joins from there (320) prove 4.98e-05, from the rich plan's (348)
        # 4.57e-05.
        binds = single_plan if single_plan is not None else hint
        steps = [b for b in [binding_step(problem, binds) if binds is not None else None]
                 if b is not None]
        # First the steps where the plan holds the most, joined: the runs it counts there
        # prove what recomputing twice costs (mamba at 60 %: 5.827e-05 for the rich plan's
        # 5.831e-05, where the steps below proved 4.98e-05).
        def enough(value: float) -> bool:
            return fits and _close_enough(hint.cost, value, options, tolerance)

        if hint is not None:
            rich = loaded_bound(problem, budget, hint, part.within(LOADED_SHARE * part.left()),
                                enough)
        if not enough(rich.value):
            found = recompute_bound(problem, budget, time_limit=part.limit, steps=steps,
                                    rich=True, deadline=part)
            rich = max(rich, found, key=lambda bound: bound.value)
    # The single call's relaxation steps, proven over the rich space too (`optimal`'s driver).
    joint = info.get("rich_joint_bound", 0.0)
    if joint > rich.value and joint > (single_step_bound or 0.0):
        rich = Bound(joint, tuple(info.get("rich_joint_steps", info.get("relaxation_steps", ()))),
                     False)
    if single_step_bound is not None and single_step_bound > rich.value:
        rich = replace(rich, value=single_step_bound)
        info["rich_bound_from"] = "the single model's bound from one backward step"
        info["bound_from"] = "one backward step (it holds over the rich space)"
    elif rich.steps:
        info["bound_from"] = f"backward steps over the rich space ({rich.where(problem)})"
    info["rich_bound"] = rich.value
    if rich.value == math.inf and below is not None:
        raise below
    if rich.value == math.inf:
        raise BudgetError(f"no schedule fits the budget of {budget} bytes, even recomputing "
                          "values several times or offloading them (a single backward step "
                          f"holds more: {rich.where(problem)})", budget=budget, smallest=None)
    if fits and _close_enough(hint.cost, rich.value, options, tolerance):
        info["rich"] = "not searched: the plan meets the bound over the rich space"
        return done(hint, rich.value, fallback)

    if "rich" in info:
        return done(hint, rich.value, fallback)
    expected = modelled("rich model", len(problem)) if deadline.deterministic else (
        BUILD_EVALUATIONS * evaluation)
    if expected > BUILD_SHARE_OF_LEFT * work.left() or not work.check("building the rich model"):
        info["rich"] = f"not built: would take about {expected:.1f} s"
        work.stop("building the rich model", f"would take about {expected:.1f} s, "
                  f"{work.left():.1f} s left")
        if fits:
            return done(hint, rich.value, fallback)
        if below is not None:
            raise below
        raise SolverError(f"optimal: no time left to build the rich model (about {expected:.1f}"
                          " s) and the single model found no schedule that fits; raise "
                          "time_limit or the budget")
    progress.update(stage="searching the rich model")
    units = rich_units(problem, options)
    found, searched = search_rich(problem, budget, options, units, hint if fits else None,
                                  work, rich.value, progress, info)
    bound = max(rich.value, searched)
    if found is None and below is not None and not fits:
        if searched == math.inf:  # proven: nothing fits in the rich space either
            raise below
        raise BudgetError(f"{below} (nor did the rich model find a schedule in the time left)",
                          budget=budget, smallest=below.smallest, dominant=below.dominant,
                          remedy=below.remedy, schedule=below.schedule)
    if searched == math.inf and not fits:
        raise BudgetError(f"no schedule fits the budget of {budget} bytes in the rich model "
                          f"(up to {options.max_copies} recomputations per value)",
                          budget=budget, smallest=None)
    if found is not None and (not fits or (found.cost, found.peak) < (hint.cost, hint.peak)):
        return done(found, bound, "rich")
    if fits:
        return done(hint, bound, fallback)
    raise SolverError(f"optimal: the rich model found no schedule within the time limit of "
                      f"{options.time_limit:g} s and the single model none that fits; raise "
                      "time_limit or the budget")


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


def rich_units(problem: Problem, options: SolverOptions) -> Units:
    """`Units.of`, with a cost unit coarse enough that every run the rich model may make and
    every transfer together stay within MAX_RICH_COST_UNITS (CP-SAT called a cost of 2**30.1
    units OPTIMAL where one of 2**30.0 was feasible, with a lower bound on the cost near it)."""
    units = Units.of(problem, options)
    runs = (options.max_copies + 1) * sum(problem.ops[v].cost for v in problem.forward)
    bandwidth = problem.host_bandwidth
    moved = sum(2 * problem.ops[v].size / bandwidth for v in problem.candidates) if bandwidth else 0
    # With a host link, the transfers are timed on the step's own clock (rich_offload).
    clock = problem.total_cost if bandwidth else 0
    return replace(units, cost=max(units.cost, (runs + moved + clock) / MAX_RICH_COST_UNITS))


def search_rich(problem: Problem, budget: int, options: SolverOptions, units: Units,
                hint: Schedule | None, deadline: Deadline, floor: float, progress: Progress,
                info: dict) -> tuple[Schedule | None, float]:
    """The rich model's least cost (then least peak at that cost) until `deadline`: its
    schedule (None: none found) and the bound its search proved that holds over the rich space
    (0 where the model does not span it or rounds bytes; math.inf: nothing fits)."""
    began = time.perf_counter()
    deadline.charge(modelled("rich model", len(problem)))
    try:
        model = RichModel(problem, units, options.max_copies, problem.host_bandwidth is not None,
                          deadline)
    except OutOfTime:
        info["rich"] = "not built: stopped at the deadline"
        return None, 0.0
    m = model.model
    info.update(rich_variables=len(m.Proto().variables),
                rich_build_time=time.perf_counter() - began)
    # The model spans the rich space, so its bound holds there, unless it offloads: then its
    # transfers' cost is an upper bound (rich_offload) and its bound holds for itself only.
    valid = units.exact_bytes and not model.load
    capacity = units.capacity(budget)
    if model.fixed_peak > capacity:
        return None, math.inf if valid else 0.0
    m.Add(model.peak <= capacity)
    if floor > 0:  # each cost rounds down by less than a unit
        m.Add(model.cost >= math.floor(floor / units.cost) - model.terms)
    m.Minimize(model.cost)
    if hint is not None:
        info["rich_hinted"] = model.hint(hint)
    trace = Trace(units, began, options.on_solution, progress, enough=floor / (1 - 1e-4),
                  slack=model.terms)
    solver = cp_solver(options, deadline, deadline.left() - PEAK_STAGE_SHARE * deadline.limit,
                       progress, units)
    status = run_solver(solver, m, deadline, "searching the rich model", trace)
    info.update(rich_time=solver.WallTime(), rich_status=solver.StatusName(status))
    if status == cp_model.INFEASIBLE:
        return None, math.inf if valid else 0.0
    searched = solver.BestObjectiveBound() * units.cost
    searched = searched if valid and math.isfinite(searched) else 0.0
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None, searched
    positions, offload = model.decision(solver.Value)
    deadline.charge(modelled("evaluation", len(problem)))
    schedule = rich_schedule(problem, positions, offload)
    if schedule.cost > 0 and deadline.left() > 0.05 and deadline.check(
            "lowering the peak at that cost (rich model)"):  # tight ends
        progress.update(stage="lowering the peak at that cost (rich model)")
        m.Add(model.cost <= round(solver.ObjectiveValue()))
        m.Minimize(model.peak)
        model.hint(schedule)
        solver = cp_solver(options, deadline)
        status = run_solver(solver, m, deadline, "lowering the peak (rich model)")
        if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            info["rich_model_peak"] = solver.Value(model.peak) * units.byte
            info["rich_peak_proven"] = status == cp_model.OPTIMAL
            deadline.charge(modelled("evaluation", len(problem)))
            better = rich_schedule(problem, *model.decision(solver.Value))
            if (better.cost, better.peak) <= (schedule.cost, schedule.peak):
                schedule = better
    return schedule, searched


def rich_schedule(problem: Problem, positions: dict[int, list[int]],
                  offload: dict[int, int], **fields) -> Schedule:
    """The schedule of the rich model's runs: each value's first backward position is its
    `recompute_at`, the others are `again` (the model assigns reads by simulate's rule, so
    every run it makes serves a read, as make_schedule requires)."""
    nf = problem.num_forward
    recompute_at = {v: min(p for p in ps if p >= nf) for v, ps in positions.items()
                    if max(ps) >= nf}
    again = {v: tuple(sorted(p for p in ps if p != recompute_at.get(v)))
             for v, ps in positions.items()}
    return make_schedule(problem, set(recompute_at), recompute_at=recompute_at,
                         again={v: ps for v, ps in again.items() if ps}, offload_at=offload,
                         **fields)
