"""The least simulated peak of a small problem, by brute force (None: too large to enumerate)."""
from remat.errors import BudgetError
from remat.solvers import SolverOptions, Strategy, solve
from remat.solvers.core.problem import Problem

ORACLE = SolverOptions(cost_resolution=1e-9, workers=2, time_limit=30)


def brute_least_peak(problem: Problem) -> int | None:
    """Every schedule's least peak, proven by enumeration: a budget of 0 either fits (a plan
    of no activations) or the BudgetError names it."""
    try:
        return solve(problem, 0, Strategy.BRUTE_FORCE, ORACLE).peak
    except ValueError:
        return None
    except BudgetError as error:
        return error.smallest
