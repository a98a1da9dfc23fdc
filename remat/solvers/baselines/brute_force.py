"""Strategy `brute_force`: every schedule of a tiny problem, simulated; the oracle for tests.

It enumerates exactly what `optimal` may choose under the same options: every set of recomputed
values, each placed just in time (make_schedule's default) unless
`options.free_positions`, and then also every placement of the recomputations. The latest
placement does not dominate, which is why the free mode exists:
- recomputing v earlier can end a big saved input's life sooner (its last other reader is early,
  and v would otherwise hold it until v's first use), which beats holding the small v longer;
- v's `temp` bytes land on v's recomputation step, and an earlier step may have less live.
So for each set, each recomputation (a tuple op and the getitems recomputed with it as one) takes
every backward position from the first backward op to the latest its recomputed readers allow.
"""
from __future__ import annotations

import itertools
from dataclasses import replace
from types import MappingProxyType

from remat.errors import BudgetError
from remat.solvers.core.options import SolverOptions
from remat.solvers.core.problem import Problem, tuple_of
from remat.solvers.core.strategy import Strategy
from remat.solvers.core.schedule import Schedule, Status, recomputable
from remat.solvers.timeline.evaluate import evaluate, make_schedule
from remat.solvers.timeline.simulate import simulate

MAX_CANDIDATES = 16
MAX_SCHEDULES = 200_000


def placements(problem: Problem, recomputed: frozenset[int]):
    """Every valid `recompute_at` for the set `recomputed` (tuple ops included)."""
    nf = problem.num_forward
    readers = problem.storage_readers
    groups: dict[int, list[int]] = {}
    for v in recomputed:
        t = tuple_of(problem, v)
        groups.setdefault(v if t is None else t, []).append(v)
    # A reader has a larger index than what it reads, and a getitem's readers are not getitems
    # of the same tuple, so deciding groups from the largest key down sees every reader first.
    keys = sorted(groups, reverse=True)
    pos: dict[int, int] = {}

    def assign(k: int):
        if k == len(keys):
            yield dict(pos)
            return
        members = groups[keys[k]]
        upper = min(r if r >= nf else pos[r] for v in members for r in readers[v]
                    if r >= nf or (r in pos and r not in members))
        for b in range(nf, upper + 1):
            for v in members:
                pos[v] = b
            yield from assign(k + 1)
        for v in members:
            del pos[v]

    yield from assign(0)


def brute_force(problem: Problem, budget: int, options: SolverOptions) -> Schedule:
    """The least-cost, then least-peak, schedule that fits, by enumeration. Refuses problems
    with more than MAX_CANDIDATES recomputable values or MAX_SCHEDULES schedules."""
    choices = recomputable(problem)
    if len(choices) > MAX_CANDIDATES:
        raise ValueError(f"brute_force enumerates every schedule and takes at most "
                         f"{MAX_CANDIDATES} recomputable values; this problem has "
                         f"{len(choices)}: use the optimal strategy")
    seen: set[frozenset[int]] = set()
    best: Schedule | None = None
    smallest: int | None = None
    count = 0
    for k in range(len(choices) + 1):
        for subset in itertools.combinations(choices, k):
            try:
                base = make_schedule(problem, subset)
            except ValueError:
                continue  # recomputes something the backward never needs
            if base.recomputed in seen:
                continue
            seen.add(base.recomputed)
            cost = evaluate(problem, base).cost
            choices_of_place = (placements(problem, base.recomputed) if options.free_positions
                                else [dict(base.recompute_at)])
            for positions in choices_of_place:
                count += 1
                if count > MAX_SCHEDULES:
                    raise ValueError(f"brute_force stops at {MAX_SCHEDULES:,} schedules; this "
                                     "problem has more placements: use the optimal strategy")
                schedule = replace(base, recompute_at=MappingProxyType(positions), cost=cost)
                peak = simulate(problem, schedule).peak
                smallest = peak if smallest is None else min(smallest, peak)
                if peak <= budget and (best is None or (cost, peak) < (best.cost, best.peak)):
                    best = replace(schedule, peak=peak)
    if best is None:
        raise BudgetError(f"brute_force: no schedule fits a budget of {budget:,} bytes; the "
                          f"smallest activation peak any schedule reaches is {smallest:,} bytes, "
                          "and recomputation cannot go lower", budget=budget, smallest=smallest)
    return evaluate(problem, best, strategy=Strategy.BRUTE_FORCE.value, status=Status.OPTIMAL,
                    budget=budget, bound=best.cost, info={"schedules": count})
