"""Exhaustive search over eager policies: the oracle of the exact eager model's tests.

Every subset of the cacheable ops (`EagerBlocks.cacheable`) is a policy; each is judged by the
eager timeline (`eager_schedule`), nothing here shares the CP-SAT model's reasoning. Subsets
that `block_runs` closes to the same cache (groups) are evaluated again: the search stays
independent of how the model forms its decisions.
"""
from __future__ import annotations

import itertools

from remat.errors import BudgetError
from remat.solvers.timeline.eager import eager_schedule
from remat.solvers.timeline.eager_blocks import EagerBlocks
from remat.solvers.core.problem import Problem
from remat.solvers.core.schedule import Schedule, Status

MAX_CACHEABLE = 14  # 16,384 policies


def eager_policies(problem: Problem, blocks: EagerBlocks):
    """Every policy's schedule (`eager_schedule`), one per subset of the cacheable ops."""
    cacheable = sorted(blocks.cacheable)
    if len(cacheable) > MAX_CACHEABLE:
        raise ValueError(f"{len(cacheable)} cacheable ops: more than {MAX_CACHEABLE} to "
                         "enumerate")
    for k in range(len(cacheable) + 1):
        for cached in itertools.combinations(cacheable, k):
            yield eager_schedule(problem, blocks, cached, strategy="eager_brute_force",
                                 status=Status.OPTIMAL)


def eager_brute_force(problem: Problem, blocks: EagerBlocks, budget: int) -> Schedule:
    """The least-cost, then least-peak, policy whose eager peak fits `budget` (OPTIMAL).
    Raises BudgetError naming the least eager peak when none fits."""
    best, least = None, None
    for schedule in eager_policies(problem, blocks):
        least = schedule.peak if least is None else min(least, schedule.peak)
        if schedule.peak <= budget and (best is None or (schedule.cost, schedule.peak)
                                        < (best.cost, best.peak)):
            best = schedule
    if best is None:
        raise BudgetError(f"eager_brute_force: no policy fits {budget:,} bytes; the least "
                          f"eager peak is {least:,}", budget=budget, smallest=least)
    return best


def eager_smallest_peak(problem: Problem, blocks: EagerBlocks) -> int:
    """The least eager peak of any policy."""
    return min(s.peak for s in eager_policies(problem, blocks))


def budget_between(problem: Problem, blocks: EagerBlocks, where: float) -> tuple[int, int]:
    """The least eager peak of any policy, and a budget `where` (0 to 1) of the way from it to
    caching everything's peak: the tests' draw of a budget that some policy meets."""
    low = eager_smallest_peak(problem, blocks)
    high = eager_schedule(problem, blocks, blocks.cacheable).peak
    return low, low + int(where * max(0, high - low))
