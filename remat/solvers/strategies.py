"""The strategies by name, and the table they register in: one signature for all,
``(problem, budget bytes, options) -> Schedule``. Each strategy's module registers itself on
import (`register`); `remat.solvers.registry.solve` imports them all and picks one."""
from __future__ import annotations

import enum
from typing import Callable

from remat.solvers.options import SolverOptions
from remat.solvers.problem import Problem
from remat.solvers.schedule import Schedule

__all__ = ["STRATEGIES", "Strategy", "StrategyFn", "register"]

StrategyFn = Callable[[Problem, int, SolverOptions], Schedule]


class Strategy(str, enum.Enum):
    SAVE_ALL = "save_all"
    CHECKPOINT_BLOCKS = "checkpoint_blocks"
    CHEN_SQRT = "chen_sqrt"
    GREEDY = "greedy"
    SELECTIVE = "selective"
    OPTIMAL = "optimal"
    BRUTE_FORCE = "brute_force"
    TILED = "tiled"


STRATEGIES: dict[Strategy, StrategyFn] = {}


def register(name: Strategy) -> Callable[[StrategyFn], StrategyFn]:
    def add(fn: StrategyFn) -> StrategyFn:
        STRATEGIES[name] = fn
        return fn
    return add
