"""The eager mode's heuristic planner (`remat.solvers.timeline.eager` holds the mode's
timeline). Torch-free.

`plan_eager` (status HEURISTIC): from seed cache sets it repairs (caches less) until the eager
peak fits and improves (caches more) while it still fits; `cheapest_prefix` is a seed found in
a few evaluations; `with_offloads` plans again with, where the problem has a host link, the
block inputs whose transfers hide kept in host memory (`remat.solvers.timeline.eager_offload`
says which may go; `choose_offloads` picks them), for when that costs less. The exact planner, which
they hint, is `remat.solvers.eager.search.optimal_eager` (it offloads nothing).
"""
from __future__ import annotations

from dataclasses import replace
from types import MappingProxyType
from typing import Callable, Iterable

from remat.errors import BudgetError
from remat.solvers.core.deadline import Deadline
from remat.solvers.core.problem import Kind, Problem
from remat.solvers.core.schedule import Schedule
from remat.solvers.timeline.eager import eager_schedule
from remat.solvers.timeline.eager_blocks import EagerBlocks, block_runs
from remat.solvers.timeline.eager_offload import offloadable

__all__ = ["cheapest_prefix", "choose_offloads", "plan_eager", "with_offloads"]


def cheapest_prefix(problem: Problem, blocks: EagerBlocks, budget: int,
                    deadline: Deadline | None = None) -> frozenset[int]:
    """A seed for `plan_eager` in a few evaluations (a bisection): the longest prefix of the
    ops the blocks recompute, the most recompute seconds per byte first, whose caching fits
    `budget` (the peak need not grow with the prefix: this is where the bisection lands).
    T5 (234 such ops): 0.1 s, where plan_eager's passes take 5 s from the empty seed; an
    evaluation of Llama-3-8B's 7,562 ops takes 0.07 s on a quiet core, more under load, so
    past `deadline` the bisection stops at the longest prefix found to fit so far."""
    recomputed = eager_schedule(problem, blocks, ()).recomputed
    order = sorted((v for v in blocks.cacheable if v in recomputed and problem.ops[v].size > 0
                    and problem.ops[v].kind is Kind.TENSOR),
                   key=lambda v: (-(problem.ops[v].cost + 1e-15) / problem.ops[v].size, v))
    low, high = 0, len(order)
    while low < high and (deadline is None or deadline.check("eager: first seed")):
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
    A heuristic: status HEURISTIC (`remat.solvers.eager.search` is the exact planner,
    which this starts). Raises BudgetError with the least peak seen when no seed fits however
    little it caches. Past `deadline`, it stops improving and tries no further seed (one
    schedule is evaluated at a time, each O(ops)); where none fitted by then, caching nothing
    (every block checkpointed), where it fits, is the answer, with info["last_resort"]."""
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
    if best is None and out_of_time():  # the repairs' end, caching nothing, in one evaluation
        schedule = run(set())
        least = min(least, schedule.peak) if least is not None else schedule.peak
        if schedule.peak <= budget:
            return replace(schedule, info=MappingProxyType({**schedule.info, "last_resort": (
                "every block checkpointed, caching nothing: no time to repair the seeds")}))
    if best is None:
        raise BudgetError(
            f"eager: no checkpoint policy found fits; the least eager peak seen is {least:,} "
            f"bytes of activations (found by the heuristic, not proven the least), above the "
            f"budget of {budget:,}; checkpoint more modules (blocks=) or raise the budget",
            budget=budget, smallest=least, proven=False)
    return best


def with_offloads(problem: Problem, blocks: EagerBlocks, budget: int,
                  seeds: Iterable[Iterable[int]], best: Schedule | None,
                  deadline: Deadline | None = None) -> Schedule | None:
    """`best` (`plan_eager`'s policy; None: none fits), or where it costs less (or only it
    fits), the policy planned with the block inputs whose transfers hide kept in host memory
    (`choose_offloads`, judged under `best`'s cache; then
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


def choose_offloads(problem: Problem, eligible: dict[int, str],
                    schedule_of: Callable[[frozenset[int]], Schedule],
                    deadline: Deadline | None = None) -> frozenset[int]:
    """The offloads to plan with: largest first, each taken when the host holds it
    (`Problem.host_capacity`) and the step waits no longer for the transfers with it
    (`schedule_of(offloads)`'s `exposed_time`, under some fixed cache): what moves to host
    for free, making room to cache (and recompute) less. Past `deadline`, those chosen so far
    (one schedule is evaluated per candidate)."""
    capacity, ops = problem.host_capacity, problem.ops
    chosen: frozenset[int] = frozenset()
    held, exposed = 0, schedule_of(chosen).exposed_time
    for s in sorted(eligible, key=lambda s: (-ops[s].size, s)):
        if deadline is not None and not deadline.check("eager offloads"):
            break
        if capacity is not None and held + ops[s].size > capacity:
            continue
        trial = schedule_of(chosen | {s})
        if trial.exposed_time <= exposed + 1e-12:
            chosen, held, exposed = chosen | {s}, held + ops[s].size, trial.exposed_time
    return chosen
