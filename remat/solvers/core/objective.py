"""What "least recompute" means: the cost every strategy minimizes.

Strategies minimize `Op.cost`. By default that is seconds on the target device (``"time"``),
which charges a memory-bound pointwise op its bytes moved. ``"flops"`` minimizes the recompute
FLOPs instead, the quantity that separates hardware FLOPs from model FLOPs (HFU from MFU) and
that FLOP counters such as torch's `FlopCounterMode` report; time breaks the ties, so that among
plans of equal FLOPs the faster one wins and a zero-FLOP op is never quite free.

`with_objective` returns a problem whose costs are the objective's; solve it, then `evaluate`
the schedule on the original problem to get seconds and FLOPs back (`remat.solvers.solve`
does both when `SolverOptions.objective` says so).
"""
from __future__ import annotations

import enum
from dataclasses import replace

from remat.solvers.core.problem import Problem

__all__ = ["Objective", "TIME_TIE_BREAK", "with_objective"]

# Seconds weigh this much against FLOPs (both as shares of the step's total): small enough that
# FLOPs decide unless two plans are within 0.1 % of the step's recompute time of each other in
# FLOPs, large enough to stay above the exact solver's cost resolution for a real pointwise op.
TIME_TIE_BREAK = 1e-3


class Objective(str, enum.Enum):
    TIME = "time"  # recompute seconds on the target device
    FLOPS = "flops"  # recompute FLOPs, then seconds

    @classmethod
    def of(cls, value: "Objective | str") -> "Objective":
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"unknown objective {value!r}; choose one of "
                             f"{', '.join(o.value for o in cls)}") from None


def with_objective(problem: Problem, objective: Objective | str) -> Problem:
    """`problem` with each op's cost replaced by the objective's (the same problem for time).
    FLOPs costs are in FLOPs: ``flops + TIME_TIE_BREAK * seconds * (total FLOPs / total
    seconds)``; a problem without FLOPs falls back to seconds alone."""
    objective = Objective.of(objective)
    if objective is Objective.TIME:
        return problem
    total_flops, total_time = problem.total_flops, problem.total_cost
    per_second = total_flops / total_time if total_time > 0 and total_flops > 0 else 1.0
    ops = tuple(replace(op, cost=op.flops + TIME_TIE_BREAK * op.cost * per_second)
                for op in problem.ops)
    # A transfer does no FLOPs: under this objective its seconds only break ties, as an op's do.
    bandwidth = (None if problem.host_bandwidth is None
                 else problem.host_bandwidth / (TIME_TIE_BREAK * per_second))
    return Problem(ops, name=problem.name, source={**problem.source, "objective": objective.value},
                   host_bandwidth=bandwidth, host_capacity=problem.host_capacity)
