"""Offload where it pays, on a plan of any size: a local search on top of a schedule, priced by
the exact transfer timeline (`remat.solvers.overlap`) and judged by `simulate`.

The rich CP-SAT model chooses offloads exactly on small steps only (`cpsat.rich_offload`); on a
7B or 70B model's step it is not built. There, what offload buys is mostly this: a value the
plan recomputes can instead be kept in host memory (its transfers hidden under the compute)
and loaded back where the plan recomputed it, for none of the recompute time, and its inputs,
read only by that recomputation, need not be kept at all. Two moves, each taken only when the
result fits the budget and the host's capacity and costs less (or, for the first, no more):
- **make room**: offload a value the plan saves (largest first), loaded back where the plan
  first needs it, when the step waits no longer and the peak does not rise: room for the next
  move;
- **keep instead of recompute**: a recomputed value (most recompute time first) is saved and
  offloaded, loaded back at its recomputation's place or earlier (more of the load hidden,
  held longer), whichever fits and costs least.
Passes repeat until neither move improves or the deadline passes. A heuristic: the result is
never worse than the schedule it starts from, and is exactly priced; nothing is claimed about
optimality.
"""
from __future__ import annotations

import time
from types import MappingProxyType

from remat.solvers.overlap import host_bytes
from remat.solvers.problem import Kind, Problem, tuple_of
from remat.solvers.schedule import Schedule, drop_unneeded, evaluate, make_schedule

# How many earlier load positions a value is tried at besides its recomputation's (halving
# the distance to the backward's start each time).
EARLIER_TRIES = 3


def improve_by_offload(problem: Problem, budget: int, schedule: Schedule, *,
                       deadline: float) -> Schedule:
    """`schedule` improved by offloading (module docstring); the same schedule when the
    problem has no host link or nothing pays. The result is evaluated; its `info` (and other
    fields) are `schedule`'s, with "offload_search" added when it changed."""
    if not problem.host_bandwidth:
        return schedule
    best, tried = schedule, 0
    changed = True
    while changed and time.perf_counter() < deadline:
        changed = False
        for move in (_make_room, _keep_instead):
            found, count = move(problem, budget, best, deadline)
            tried += count
            if found is not None:
                best, changed = found, True
    if best is schedule:
        return schedule
    info = {**schedule.info, "offload_search": {"tried": tried,
                                                "offloaded": len(best.offload_at),
                                                "from_cost": schedule.cost}}
    return evaluate(problem, best, strategy=schedule.strategy, status=schedule.status,
                    budget=schedule.budget, bound=schedule.bound,
                    solve_time=schedule.solve_time, info=MappingProxyType(info))


def _fits(problem: Problem, budget: int, schedule: Schedule) -> bool:
    capacity = problem.host_capacity
    return schedule.peak <= budget and (capacity is None
                                        or host_bytes(problem, schedule) <= capacity)


def _try(problem: Problem, recomputed, recompute_at, again, offload_at) -> Schedule | None:
    try:
        return make_schedule(problem, recomputed, recompute_at=recompute_at, again=again,
                             offload_at=offload_at)
    except ValueError:
        return None


def _first_need(problem: Problem, schedule: Schedule, v: int) -> int | None:
    """The first backward position that reads v: a backward reader, or a recomputation of a
    reader placed there."""
    nf = problem.num_forward
    needs = [r for r in problem.storage_readers[v] if r >= nf]
    needs += [schedule.recompute_at[r] for r in problem.storage_readers[v]
              if r in schedule.recompute_at]
    needs += [p for r in problem.storage_readers[v] for p in schedule.again.get(r, ()) if p >= nf]
    return min(needs, default=None)


def _positions(problem: Problem, latest: int) -> list[int]:
    """`latest`, then a few earlier backward positions."""
    nf, found = problem.num_forward, [latest]
    for _ in range(EARLIER_TRIES):
        earlier = nf + (found[-1] - nf) // 2
        if earlier >= found[-1]:
            break
        found.append(earlier)
    return found


def _make_room(problem: Problem, budget: int, best: Schedule, deadline: float):
    """One pass of the first move; (the improved schedule or None, schedules tried)."""
    ops, improved, tried = problem.ops, None, 0
    candidates = sorted((v for v in best.saved if v not in best.offload_at
                         and ops[v].kind is Kind.TENSOR and ops[v].size
                         and v not in problem.pinned), key=lambda v: (-ops[v].size, v))
    for v in candidates:
        if time.perf_counter() >= deadline:
            break
        need = _first_need(problem, best, v)
        if need is None:
            continue
        trial = _try(problem, best.recomputed, best.recompute_at, best.again,
                     {**best.offload_at, v: need})
        tried += 1
        if trial is not None and _fits(problem, budget, trial) and trial.cost <= best.cost \
                and trial.peak < best.peak:
            best = improved = trial
    return improved, tried


def _keep_instead(problem: Problem, budget: int, best: Schedule, deadline: float):
    """One pass of the second move; (the improved schedule or None, schedules tried)."""
    ops, improved, tried = problem.ops, None, 0
    candidates = sorted((v for v in best.recomputed if ops[v].kind is Kind.TENSOR
                         and ops[v].size and ops[v].cost > 0 and v not in best.again),
                        key=lambda v: (-ops[v].cost, v))
    for v in candidates:
        if time.perf_counter() >= deadline:
            break
        if v not in best.recomputed:  # dropped by an earlier move of this pass
            continue
        t = tuple_of(problem, v)
        if t is not None and any(g in best.recomputed for g in problem.users[t] if g != v):
            continue  # its tuple op runs again for its other tensors anyway
        recomputed = drop_unneeded(problem, set(best.recomputed) - {v} - ({t} if t else set()))
        at = {u: b for u, b in best.recompute_at.items() if u in recomputed}
        again = {u: ps for u, ps in best.again.items()
                 if u in recomputed or all(p < problem.num_forward for p in ps)}
        choice = None
        for b in _positions(problem, best.recompute_at[v]):
            trial = _try(problem, recomputed, at, again, {**best.offload_at, v: b})
            tried += 1
            if trial is not None and _fits(problem, budget, trial) and trial.cost < best.cost \
                    and (choice is None or (trial.cost, trial.peak) < (choice.cost, choice.peak)):
                choice = trial
        if choice is not None:
            best = improved = choice
    return improved, tried
