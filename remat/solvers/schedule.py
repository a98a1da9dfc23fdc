"""What a strategy decides: which forward values the backward recomputes, and where.

Everything else follows from that decision (DESIGN.md, "The execution model"): the forward
storages the backward needs, directly or through a recomputation, and does not recompute are
saved. `make_schedule` derives them and checks that the decision can run; `evaluate` adds
what the decision costs. Every strategy returns a `Schedule`.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Iterable, Mapping

from remat.solvers.problem import Kind, Problem, needed_storages, recompute_blocker, tuple_of


class Status(str, enum.Enum):
    OPTIMAL = "OPTIMAL"  # proven least cost at this budget (within 0.01 % of `bound`)
    FEASIBLE = "FEASIBLE"  # fits; the optimum lies between `bound` and `cost`
    HEURISTIC = "HEURISTIC"  # a baseline's answer: fits, nothing is claimed about optimality


@dataclass(frozen=True)
class Schedule:
    """A decision and, once evaluated, what it costs.

    `recompute_at[v]` is the backward op before which `v` is recomputed; several values
    recomputed before the same op run in forward order. Costs are in the problem's units:
    `cost` is recompute seconds, `peak` the simulated activation peak in bytes.
    """

    saved: frozenset[int]
    recomputed: frozenset[int]
    recompute_at: Mapping[int, int]
    strategy: str = ""
    status: Status = Status.HEURISTIC
    cost: float = 0.0
    recompute_flops: int = 0
    peak: int = 0
    budget: int | None = None
    bound: float | None = None  # best proven lower bound on `cost`, where the strategy has one
    solve_time: float = 0.0
    # Anything a strategy wants to record: solver statistics, the anytime trace.
    info: Mapping = field(default_factory=dict, compare=False)

    @property
    def gap(self) -> float | None:
        """(cost - bound) / cost, whatever the status: 0 only when the cost meets the bound (or
        is 0); None without a bound (a baseline's). Float noise below 0 reads as 0."""
        if self.bound is None:
            return None
        if self.cost <= 0:
            return 0.0
        return max(0.0, (self.cost - self.bound) / self.cost)

    def to_dict(self, problem: Problem | None = None) -> dict:
        name = (lambda i: problem.ops[i].name) if problem is not None else (lambda i: i)
        return {
            "strategy": self.strategy, "status": self.status.value, "cost": self.cost,
            "recompute_flops": self.recompute_flops, "peak": self.peak, "budget": self.budget,
            "bound": self.bound, "gap": self.gap, "solve_time": self.solve_time,
            "saved": sorted(name(i) for i in self.saved),
            "recomputed": sorted(name(i) for i in self.recomputed),
            "recompute_at": {name(v): name(b) for v, b in sorted(self.recompute_at.items())},
        }


def make_schedule(problem: Problem, recomputed: Iterable[int], *,
                  recompute_at: Mapping[int, int] | None = None, **fields) -> Schedule:
    """The schedule that recomputes `recomputed` (forward op indices) and saves the rest of what
    the backward needs. Without `recompute_at`, each value is recomputed just before the first
    backward op that needs it, directly or through another recomputation: the latest point,
    which holds it for the shortest time. A value taken out of a tuple op brings the tuple op
    with it (a tuple cannot be saved). Raises ValueError, naming the op, for a decision that
    cannot run. The result is evaluated (cost, FLOPs, simulated peak) and carries `fields`
    (strategy, status, budget, ...)."""
    ops = problem.ops
    nf = problem.num_forward
    recomputed = set(recomputed)
    pinned = problem.pinned
    for v in sorted(recomputed, key=repr):
        if not (isinstance(v, int) and 0 <= v < nf):
            raise ValueError(f"cannot recompute {v!r}: not a forward op of the problem")
        op = ops[v]
        if op.kind is Kind.VIEW:
            raise ValueError(f"cannot recompute view {op.name!r}: views are rebuilt from their "
                             "base; recompute the base")
        reason = recompute_blocker(problem, v)
        if reason is not None:
            raise ValueError(f"cannot recompute {op.name!r}: it is not recomputable ({reason.value})")
        if problem.root[v] in pinned:
            raise ValueError(f"cannot recompute {op.name!r}: it is an output, kept to the end")
    recomputed |= {t for t in map(lambda v: tuple_of(problem, v), recomputed) if t is not None}

    needed = needed_storages(problem, recomputed)
    pointless = sorted(recomputed - needed)
    if pointless:
        raise ValueError(f"recomputes {ops[pointless[0]].name!r}, which the backward never needs")
    saved = needed - recomputed
    for v in saved:
        if ops[v].kind is Kind.TUPLE:
            raise ValueError(f"tuple op {ops[v].name!r} cannot be saved; recompute it or save the "
                             "tensors taken out of it")

    readers = problem.storage_readers
    if recompute_at is None:
        positions = _latest_positions(problem, recomputed, readers)
    else:
        positions = dict(recompute_at)
        _check_positions(problem, recomputed, positions, readers)
    schedule = Schedule(saved=frozenset(saved), recomputed=frozenset(recomputed),
                        recompute_at=MappingProxyType(positions))
    return evaluate(problem, schedule, **fields)


def recomputable(problem: Problem) -> list[int]:
    """Candidates that a schedule may usefully recompute: tensors owning bytes (recomputing a
    zero-byte value frees nothing), with nothing forbidding it (randomness, mutation, being an
    output)."""
    pinned = problem.pinned
    return [v for v in problem.candidates
            if problem.ops[v].kind is Kind.TENSOR and problem.ops[v].size > 0
            and recompute_blocker(problem, v) is None and v not in pinned]


def drop_unneeded(problem: Problem, recomputed: Iterable[int]) -> set[int]:
    """`recomputed` without the values that the backward would not need under that choice
    (one reached only through a value that is saved). One pass suffices: dropping a value
    that was never reached cannot change what else is reached."""
    recomputed = set(recomputed)
    for v in list(recomputed):
        t = tuple_of(problem, v)
        if t is not None:
            recomputed.add(t)
    return recomputed & needed_storages(problem, recomputed)


def evaluate(problem: Problem, schedule: Schedule, **fields) -> Schedule:
    """The schedule with its cost, recompute FLOPs and simulated peak filled in, and any other
    fields given (strategy, status, bound, budget, solve_time, info)."""
    from remat.solvers.simulate import simulate

    return replace(schedule,
                   cost=sum(problem.ops[v].cost for v in schedule.recomputed),
                   recompute_flops=sum(problem.ops[v].flops for v in schedule.recomputed),
                   peak=simulate(problem, schedule).peak, **fields)


def _latest_positions(problem: Problem, recomputed: set[int],
                      readers: tuple[tuple[int, ...], ...]) -> dict[int, int]:
    nf = problem.num_forward
    pos: dict[int, int] = {}
    # Readers have larger indices than what they read, so one reverse sweep sees every
    # recomputed reader's position before the value it reads.
    for v in sorted(recomputed, reverse=True):
        needs = [r if r >= nf else pos[r] for r in readers[v] if r >= nf or r in pos]
        if problem.ops[v].kind is Kind.TUPLE:
            needs = [pos[g] for g in problem.users[v] if g in pos]
        pos[v] = min(needs)
        if problem.ops[v].kind is Kind.TUPLE:
            for g in problem.users[v]:
                if g in pos:
                    pos[g] = pos[v]
    return pos


def _check_positions(problem: Problem, recomputed: set[int], pos: dict[int, int],
                     readers: tuple[tuple[int, ...], ...]) -> None:
    ops = problem.ops
    nf = problem.num_forward
    if set(pos) != recomputed:
        raise ValueError("recompute_at must give a position for exactly the recomputed ops")
    for v, b in pos.items():
        if not (isinstance(b, int) and nf <= b < len(ops)):
            raise ValueError(f"{ops[v].name!r} is recomputed at {b!r}, which is not a backward op")
        for r in readers[v]:
            need = r if r >= nf else pos.get(r)
            if need is not None and need < b:
                raise ValueError(f"{ops[v].name!r} is recomputed before {ops[b].name!r}, after "
                                 f"{ops[r].name!r} needs it")
        t = tuple_of(problem, v)
        if t is not None and pos[t] != b:
            raise ValueError(f"{ops[v].name!r} must be recomputed where its tuple op "
                             f"{ops[t].name!r} is: recomputing the tuple op makes it")
