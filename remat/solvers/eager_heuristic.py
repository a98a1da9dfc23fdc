"""The eager mode's heuristic planner (`remat.solvers.eager` holds the mode's timeline). Torch-free.

`plan_eager` (status HEURISTIC): from seed cache sets it repairs (caches less) until the eager
peak fits and improves (caches more) while it still fits; `cheapest_prefix` is a seed found in
a few evaluations; `with_offloads` plans again with, where the problem has a host link, the
block inputs whose transfers hide kept in host memory (`remat.solvers.eager_offload`), for
when that costs less. The exact planner, which they hint, is
`remat.solvers.cpsat.eager_search.optimal_eager` (it offloads nothing).
"""
from __future__ import annotations

from typing import Iterable

from remat.errors import BudgetError
from remat.solvers.deadline import Deadline
from remat.solvers.eager import EagerBlocks, block_runs, eager_schedule
from remat.solvers.eager_offload import choose_offloads, offloadable
from remat.solvers.problem import Kind, Problem
from remat.solvers.schedule import Schedule

__all__ = ["cheapest_prefix", "plan_eager", "with_offloads"]


def cheapest_prefix(problem: Problem, blocks: EagerBlocks, budget: int) -> frozenset[int]:
    """A seed for `plan_eager` in a few evaluations (a bisection): the longest prefix of the
    ops the blocks recompute, the most recompute seconds per byte first, whose caching fits
    `budget` (the peak need not grow with the prefix: this is where the bisection lands).
    T5 (234 such ops): 0.1 s, where plan_eager's passes take 5 s from the empty seed."""
    recomputed = eager_schedule(problem, blocks, ()).recomputed
    order = sorted((v for v in blocks.cacheable if v in recomputed and problem.ops[v].size > 0
                    and problem.ops[v].kind is Kind.TENSOR),
                   key=lambda v: (-(problem.ops[v].cost + 1e-15) / problem.ops[v].size, v))
    low, high = 0, len(order)
    while low < high:
        middle = (low + high + 1) // 2
        if eager_schedule(problem, blocks, order[:middle]).peak <= budget:
            low = middle
        else:
            high = middle - 1
    return frozenset(order[:low])


def plan_eager(problem: Problem, blocks: EagerBlocks, budget: int,
               seeds: Iterable[Iterable[int]], deadline: Deadline | None = None,
               offload: Iterable[int] = ()) -> Schedule:
    """The cheapest eager policy found from `seeds` (cache sets, e.g. what the exact plan
    saves, nothing, everything cacheable) whose eager peak fits `budget`: each seed is
    repaired by caching less (the most bytes per second of recompute first) until it fits,
    then improved by caching more (the most recompute seconds per byte first) while it fits.
    `offload`: block inputs kept in host memory (never cached), where the cache allows it.
    A heuristic: status HEURISTIC (`remat.solvers.cpsat.eager_search` is the exact planner,
    which this starts). Raises BudgetError with the least peak seen when no seed fits however
    little it caches. Past `deadline`, it stops improving and tries no further seed (one
    schedule is evaluated at a time, each O(ops))."""
    offload = frozenset(offload)  # in host memory: never cached as well
    candidates = [v for v in sorted(blocks.cacheable) if problem.ops[v].size > 0
                  and problem.ops[v].kind is Kind.TENSOR and v not in offload]
    eps = 1e-15

    def run(cached) -> Schedule:
        return eager_schedule(problem, blocks, cached, offload=offload, strict=False,
                              budget=budget)

    best: Schedule | None = None
    least = None

    def out_of_time() -> bool:
        return deadline is not None and not deadline.check("eager heuristic")

    for seed in seeds:
        if least is not None and out_of_time():
            break
        cached = set(seed) & set(candidates)
        schedule = run(cached)
        for v in sorted(cached, key=lambda v: -problem.ops[v].size / (problem.ops[v].cost + eps)):
            if schedule.peak <= budget or out_of_time():
                break
            cached.discard(v)
            schedule = run(cached)
        least = schedule.peak if least is None else min(least, schedule.peak)
        if schedule.peak > budget:
            continue
        for v in sorted(set(candidates) - cached,
                        key=lambda v: -(problem.ops[v].cost + eps) / problem.ops[v].size):
            if v not in schedule.recomputed:
                continue  # caching it would save no recomputation
            if out_of_time():
                break
            trial = run(cached | {v})
            if trial.peak <= budget and trial.cost <= schedule.cost:
                cached.add(v)
                schedule = trial
        if best is None or (schedule.cost, schedule.peak) < (best.cost, best.peak):
            best = schedule
    if best is None:
        raise BudgetError(
            f"eager: no checkpoint policy found fits; the least eager peak seen is "
            f"{least:,} bytes of activations, above the budget of {budget:,}; checkpoint more "
            "modules (blocks=) or raise the budget", budget=budget, smallest=least)
    return best


def with_offloads(problem: Problem, blocks: EagerBlocks, budget: int,
                  seeds: Iterable[Iterable[int]], best: Schedule | None,
                  deadline: Deadline | None = None) -> Schedule | None:
    """`best` (`plan_eager`'s policy; None: none fits), or where it costs less (or only it
    fits), the policy planned with the block inputs whose transfers hide kept in host memory
    (`remat.solvers.eager_offload.choose_offloads`, judged under `best`'s cache; then
    `plan_eager` from that cache first): a problem with a host link. Within `deadline`."""
    if not problem.host_bandwidth:
        return best
    cache = frozenset(best.info["cached"]) if best is not None else frozenset()
    eligible = offloadable(problem, blocks, block_runs(problem, blocks, ()))
    chosen = choose_offloads(problem, eligible, lambda offload: eager_schedule(
        problem, blocks, cache, offload=offload, strict=False), deadline)
    if not chosen:
        return best
    try:
        other = plan_eager(problem, blocks, budget, [cache, *seeds], deadline, offload=chosen)
    except BudgetError:
        return best
    if best is None or (other.cost, other.peak) < (best.cost, best.peak):
        return other
    return best
