"""`solve`: the one entry to every strategy, by name; it checks the budget, solves under the
options' objective and refuses a schedule that does not fit. Importing it registers every
strategy (`remat.solvers.strategies` holds the table)."""
from __future__ import annotations

import time
from dataclasses import replace
from types import MappingProxyType

from remat.errors import BudgetError, SolverError
from remat.solvers.options import SolverOptions, sized_and_stated
from remat.solvers.problem import Problem
from remat.solvers.objective import Objective, with_objective
from remat.solvers.schedule import Schedule, check_host_memory, evaluate
from remat.solvers.strategies import STRATEGIES, Strategy, StrategyFn, register
# Importing the strategies registers them in the table.
from remat.solvers import baselines, brute_force, cpsat, tiled  # noqa: E402,F401

# The strategies that run under `SolverOptions.time_limit` and `relative_gap`.
LIMITED = {STRATEGIES[Strategy.OPTIMAL], STRATEGIES[Strategy.TILED]}

__all__ = ["STRATEGIES", "Strategy", "StrategyFn", "register", "solve"]


def solve(problem: Problem, budget: int, strategy: Strategy | str = Strategy.OPTIMAL,
          options: SolverOptions | None = None) -> Schedule:
    """The schedule that `strategy` picks for `problem` whose simulated activation peak is at
    most `budget` bytes. Raises BudgetError when the strategy cannot fit the budget and
    SolverError when it stops with no schedule."""
    try:
        fn = STRATEGIES[Strategy(strategy)]
    except ValueError:
        known = ", ".join(s.value for s in Strategy)
        raise ValueError(f"unknown strategy {strategy!r}; choose one of: {known}") from None
    if not isinstance(budget, int) or budget < 0:
        raise ValueError(f"budget must be a non-negative int of bytes, not {budget!r}")
    options = options or SolverOptions()
    # Limits left to None chosen by size, counting the call's time before the solve.
    options, stated = sized_and_stated(options, len(problem))
    start = time.perf_counter()
    costed = with_objective(problem, options.objective)
    if costed is problem:
        schedule = fn(problem, budget, options)
    else:
        if options.hint is not None:
            options = replace(options, hint=evaluate(costed, options.hint))
        try:
            schedule = _in_problem_units(problem, fn(costed, budget, options), options.objective)
        except BudgetError as e:
            if e.schedule is not None:
                e.schedule = _in_problem_units(problem, e.schedule, options.objective)
            raise
    if schedule.peak > budget:  # a solver bug: never hand the caller a plan that does not fit
        raise SolverError(
            f"{schedule.strategy}: returned a schedule whose simulated peak {schedule.peak:,} "
            f"exceeds the budget {budget:,}; this is a bug in the strategy: please report it "
            "with the problem (remat.solvers.problem_file.dumps) and the budget")
    check_host_memory(problem, schedule)  # offloads within the host's memory, likewise
    if not schedule.solve_time:
        schedule = replace(schedule, solve_time=time.perf_counter() - start)
    if fn in LIMITED:  # the report states the limits the call ran under, and who chose them
        schedule = replace(schedule, info=MappingProxyType({**schedule.info, **stated}))
    return schedule



def _in_problem_units(problem: Problem, schedule: Schedule, objective: str) -> Schedule:
    """A schedule solved under another objective, costed in `problem`'s seconds. Its bound is
    scaled to keep the objective's gap: what is proven is proven of the objective's cost."""
    bound = None
    if schedule.bound is not None and schedule.cost > 0:
        bound = schedule.bound / schedule.cost
    evaluated = evaluate(problem, schedule, info={
        **schedule.info, "objective": Objective.of(objective).value,
        "objective_cost": schedule.cost, "objective_bound": schedule.bound})
    if bound is not None:
        evaluated = replace(evaluated, bound=bound * evaluated.cost)
    return evaluated
