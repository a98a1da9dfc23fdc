"""The strategies by name, and the one signature they share:
``(problem, budget bytes, options) -> Schedule``. The table from name to function is
`remat.solvers.entry.STRATEGIES`, written out there."""
from __future__ import annotations

import enum
from typing import Callable

from remat.solvers.core.options import SolverOptions
from remat.solvers.core.problem import Problem
from remat.solvers.core.schedule import Schedule

__all__ = ["Strategy", "StrategyFn"]

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

