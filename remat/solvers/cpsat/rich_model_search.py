"""The rich model's search (`RichModel`, `SolverOptions.model` "rich" and "auto", after the
single model's call: `remat.solvers.cpsat.rich_search`): its units, its least cost then least
peak at that cost, and the schedule of its runs.
"""
from __future__ import annotations

import math
import time
from dataclasses import replace

from ortools.sat.python import cp_model

from remat.solvers.cpsat.rich_model import RichModel
from remat.solvers.cpsat.search import Progress, Trace, cp_solver, run_solver
from remat.solvers.cpsat.units import Units
from remat.solvers.core.deadline import Deadline, OutOfTime, modelled
from remat.solvers.core.options import SolverOptions
from remat.solvers.core.problem import Problem
from remat.solvers.core.schedule import Schedule
from remat.solvers.timeline.evaluate import make_schedule

# The share of the time limit kept for the rich model's least-peak stage.
PEAK_STAGE_SHARE = 0.1
MAX_RICH_COST_UNITS = 2 ** 28


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
