"""One signature for every strategy, and the registry that picks one by name."""
from __future__ import annotations

import enum
import time
from typing import Callable

from remat.errors import SolverError
from remat.solvers.options import SolverOptions
from remat.solvers.problem import Problem
from remat.solvers.schedule import Schedule

StrategyFn = Callable[[Problem, int, SolverOptions], Schedule]


class Strategy(str, enum.Enum):
    SAVE_ALL = "save_all"
    CHECKPOINT_BLOCKS = "checkpoint_blocks"
    CHEN_SQRT = "chen_sqrt"
    GREEDY = "greedy"
    OPTIMAL = "optimal"
    BRUTE_FORCE = "brute_force"


STRATEGIES: dict[Strategy, StrategyFn] = {}


def register(name: Strategy) -> Callable[[StrategyFn], StrategyFn]:
    def add(fn: StrategyFn) -> StrategyFn:
        STRATEGIES[name] = fn
        return fn
    return add


def solve(problem: Problem, budget: int, strategy: Strategy | str = Strategy.OPTIMAL,
          options: SolverOptions | None = None) -> Schedule:
    """The schedule that `strategy` picks for `problem` whose simulated activation peak is at
    most `budget` bytes. Raises BudgetError when the strategy cannot fit the budget and
    SolverError when it stops with no schedule."""
    # Importing the strategies registers them; done here so that the registry has no cycle.
    from remat.solvers import baselines, brute_force, cpsat  # noqa: F401

    try:
        fn = STRATEGIES[Strategy(strategy)]
    except ValueError:
        known = ", ".join(s.value for s in Strategy)
        raise ValueError(f"unknown strategy {strategy!r}; choose one of: {known}") from None
    if not isinstance(budget, int) or budget < 0:
        raise ValueError(f"budget must be a non-negative int of bytes, not {budget!r}")
    start = time.perf_counter()
    schedule = fn(problem, budget, options or SolverOptions())
    if schedule.peak > budget:  # a solver bug: never hand the caller a plan that does not fit
        raise SolverError(
            f"{schedule.strategy}: returned a schedule whose simulated peak {schedule.peak:,} "
            f"exceeds the budget {budget:,}; this is a bug in the strategy: please report it "
            "with the problem (Problem.to_json) and the budget")
    if not schedule.solve_time:
        from dataclasses import replace
        schedule = replace(schedule, solve_time=time.perf_counter() - start)
    return schedule
