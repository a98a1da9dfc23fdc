"""Offload where it pays, on a plan of any size: a local search on top of a schedule, priced by
the exact transfer timeline (`remat.solvers.timeline.overlap`) and judged by `simulate`.

The rich CP-SAT model chooses offloads exactly on small steps only (`cpsat.rich_offload`); on a
7B or 70B model's step it is not built. There, what offload buys is mostly this: a value the
plan recomputes can instead be kept in host memory (its transfers hidden under the compute)
and loaded back where the plan recomputed it, for none of the recompute time, and its inputs,
read only by that recomputation, need not be kept at all. Two moves, each taken only when the
result fits the budget and the host's capacity and costs less (or, for the second, no more):
- **keep instead of recompute**: a recomputed value (most recompute time first) is saved and
  offloaded, loaded back where the compute before its recomputation's place hides the load
  twice over, or at that place, or earlier (more of the load hidden, held longer): the first
  that fits and costs less;
- **make room** (when the first is stuck): offload a value the plan saves (the largest
  first), loaded back where the compute before its first need hides it (or at that need),
  when the step waits no longer and the peak drops: room for the first move.
Values are taken in groups that grow while they pay and shrink where they do not (a 7B
step's evaluation takes a tenth of a second). Passes repeat until neither move improves or the
deadline passes. A heuristic: the result is never worse than the schedule it starts from, and
is exactly priced; nothing is claimed about optimality.
"""
from __future__ import annotations

from types import MappingProxyType
from typing import Callable

from remat.solvers.core.deadline import Deadline, modelled
from remat.solvers.timeline.overlap import host_bytes
from remat.solvers.core.problem import Kind, Problem, tuple_of
from remat.solvers.core.schedule import Schedule, drop_unneeded
from remat.solvers.timeline.evaluate import evaluate, make_schedule

# How many earlier load positions a value is tried at besides its recomputation's (halving
# the distance to the backward's start each time).
EARLIER_TRIES = 3
# How many of the largest saved values the first move considers.
ROOM_CANDIDATES = 32
# A load is first tried where the compute before its need is this many times its transfer.
HIDE = 2.0


def improve_by_offload(problem: Problem, budget: int, schedule: Schedule, *,
                       deadline: Deadline) -> Schedule:
    """`schedule` improved by offloading (module docstring) until `deadline`; the same
    schedule when the problem has no host link or nothing pays. The result is evaluated; its
    `info` (and other fields) are `schedule`'s, with "offload_search" added when it
    changed. Each schedule tried is an evaluation that deterministic mode charges."""
    if not problem.host_bandwidth:
        return schedule
    evaluation = modelled("evaluation", len(problem))

    def going() -> bool:  # time for one more evaluation
        deadline.charge(evaluation)
        return deadline.check("offload search")

    best, tried = schedule, 0
    while not deadline.expired():
        # Keep what the plan recomputes; make room only when that is stuck.
        found, count = _keep_instead(problem, budget, best, going)
        if found is None:
            found, more = _make_room(problem, budget, best, going)
            count += more
        tried += count
        if found is None:
            break
        best = found
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


def _positions(problem: Problem, latest: int, size: int) -> list[int]:
    """Where to try a load needed before `latest`: first where the compute between hides its
    transfer twice over (room for the loads queued beside it), then `latest` itself, then
    EARLIER_TRIES earlier positions (halving the distance to the backward's start)."""
    nf, ops = problem.num_forward, problem.ops
    hidden, b = 0.0, latest
    while b > nf and hidden < HIDE * size / problem.host_bandwidth:
        b -= 1
        hidden += ops[b].cost
    found = [b, latest]
    for _ in range(EARLIER_TRIES):
        found.append(nf + (found[-1] - nf) // 2)
    return found


def _make_room(problem: Problem, budget: int, best: Schedule, going: Callable[[], bool]):
    """One pass of the first move over the ROOM_CANDIDATES largest saved values; (the improved
    schedule or None, schedules tried)."""
    ops = problem.ops
    candidates = sorted((v for v in best.saved if v not in best.offload_at
                         and ops[v].kind is Kind.TENSOR and ops[v].size
                         and v not in problem.pinned and _first_need(problem, best, v)),
                        key=lambda v: (-ops[v].size, v))[:ROOM_CANDIDATES]

    def offloaded(current: Schedule, group: list[int], earlier: int = 0) -> Schedule | None:
        loads = {v: _positions(problem, _first_need(problem, current, v), ops[v].size)[earlier]
                 for v in group}
        return _try(problem, current.recomputed, current.recompute_at, current.again,
                    {**current.offload_at, **loads})

    def better(current: Schedule, trial: Schedule) -> bool:
        return _fits(problem, budget, trial) and trial.cost <= current.cost \
            and trial.peak < current.peak

    return _in_groups(candidates, best, offloaded, better, going, retries=1)


def _keep_instead(problem: Problem, budget: int, best: Schedule,
                  going: Callable[[], bool]):
    """One pass of the second move; (the improved schedule or None, schedules tried)."""
    ops = problem.ops

    def alone(v: int) -> bool:  # a tuple op's tensor whose siblings are not recomputed
        t = tuple_of(problem, v)
        return t is None or not any(g in best.recomputed for g in problem.users[t] if g != v)

    candidates = sorted((v for v in best.recomputed if ops[v].kind is Kind.TENSOR
                         and ops[v].size and ops[v].cost > 0 and v not in best.again
                         and alone(v)), key=lambda v: (-ops[v].cost, v))

    def kept(current: Schedule, group: list[int], earlier: int = 0) -> Schedule | None:
        group = [v for v in group if v in current.recomputed]
        if not group:
            return None
        tuples = {t for t in map(lambda v: tuple_of(problem, v), group) if t is not None}
        recomputed = drop_unneeded(problem, set(current.recomputed) - set(group) - tuples)
        at = {u: b for u, b in current.recompute_at.items() if u in recomputed}
        again = {u: ps for u, ps in current.again.items()
                 if u in recomputed or all(p < problem.num_forward for p in ps)}
        loads = {v: _positions(problem, current.recompute_at[v], ops[v].size)[earlier]
                 for v in group}
        return _try(problem, recomputed, at, again, {**current.offload_at, **loads})

    def better(current: Schedule, trial: Schedule) -> bool:
        return _fits(problem, budget, trial) and trial.cost < current.cost

    return _in_groups(candidates, best, kept, better, going, retries=EARLIER_TRIES + 1)


def _in_groups(candidates: list[int], best: Schedule, move, better,
               going: Callable[[], bool], retries: int = 0):
    """Apply `move(schedule, group)` to consecutive groups of `candidates`, keeping each
    result `better` than the schedule so far: a group that is taken doubles the next one's
    size, one that is not halves it, down to one value, which is then tried `retries` more
    times (`move(schedule, [v], k)`) before it is passed. (the improved schedule or None,
    schedules tried): O(log n) tries per value refused, where one by one is n tries. Stops
    when `going()` (asked before each try) says the time is spent."""
    improved, tried, i, size = None, 0, 0, max(1, len(candidates) // 8)
    while i < len(candidates) and going():
        group = candidates[i:i + size]
        trial = move(best, group)
        tried += trial is not None
        if trial is not None and better(best, trial):
            best = improved = trial
            i, size = i + size, 2 * size
            continue
        if size > 1:
            size //= 2
            continue
        for k in range(1, retries + 1):
            if not going():
                break
            trial = move(best, group, k)
            tried += trial is not None
            if trial is not None and better(best, trial):
                best = improved = trial
                break
        i += 1
    return improved, tried
