"""What a strategy decides: which forward values the backward recomputes, and where.

Everything else follows from that decision (docs/execution-model.md): the forward storages
the backward needs, directly or through a recomputation, and does not recompute are saved.
`decide` derives them and checks that the decision can run; the timeline's `make_schedule`
(`remat.solvers.timeline.evaluate`) adds what the decision costs. Every strategy returns a
`Schedule`.

Beyond one recomputation (the richer execution model), a schedule may also
- recompute a forward value *again*: within the forward, before a later forward reader (its
  earlier copy then dies after its last reader before that point: long skip connections), or a
  second time in the backward, after its first backward recomputation (`again`);
- *offload* a saved value to host memory after its last forward reader and load it back before
  a backward op (`offload_at`); the transfers run on copy streams beside the compute, and cost
  the step only the time it waits for them (`remat.solvers.timeline.overlap`;
  `Problem.host_bandwidth`), and the host holds the offloaded bytes (at most
  `Problem.host_capacity`).
Every read of a value is served by its latest copy made before the read; each copy lives from
the step that makes it to the last read it serves (`remat.solvers.timeline.simulate`).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Iterable, Mapping

from remat.solvers.core.problem import Kind, Problem, needed_storages, recompute_blocker, tuple_of


# A plan is OPTIMAL when its cost is within this fraction (0.01 %) of a proven lower bound.
OPTIMAL_TOLERANCE = 1e-4


class Status(str, enum.Enum):
    OPTIMAL = "OPTIMAL"  # proven least cost at this budget (within OPTIMAL_TOLERANCE of `bound`)
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
    # The richer execution model: further recomputations of forward value v, each before op p
    # (a forward op: recomputed within the forward; a backward op after recompute_at[v]: a
    # second backward recomputation), and saved values offloaded to the host, each loaded back
    # before the backward op given. Empty in the one-recomputation model.
    again: Mapping[int, tuple[int, ...]] = field(default_factory=lambda: MappingProxyType({}))
    offload_at: Mapping[int, int] = field(default_factory=lambda: MappingProxyType({}))
    transfer_time: float = 0.0  # host-link seconds of the offloads, both ways
    exposed_time: float = 0.0  # of those, the seconds the step waits for (included in `cost`)

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
            "again": {name(v): [name(p) for p in ps] for v, ps in sorted(self.again.items())},
            "offload_at": {name(v): name(b) for v, b in sorted(self.offload_at.items())},
            "transfer_time": self.transfer_time, "exposed_time": self.exposed_time,
        }

    # Read-only views (MappingProxyType) keep a schedule's decisions from changing under the
    # problem's evaluation, but pickle cannot copy them: pickled as dicts, made views again.
    _VIEWS = ("recompute_at", "again", "offload_at")

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        for name in (*self._VIEWS, "info"):
            if isinstance(state.get(name), MappingProxyType):
                state[name] = dict(state[name])
        return state

    def __setstate__(self, state: dict) -> None:
        for name, value in state.items():
            if name in self._VIEWS:
                value = MappingProxyType(value)
            object.__setattr__(self, name, value)

    @property
    def recomputations(self) -> int:
        """How many times the step runs a forward op again, all copies counted."""
        return len(self.recomputed) + sum(len(ps) for ps in self.again.values())


def decide(problem: Problem, recomputed: Iterable[int], *,
           recompute_at: Mapping[int, int] | None = None,
           again: Mapping[int, Iterable[int]] | None = None,
           offload_at: Mapping[int, int] | None = None) -> Schedule:
    """The schedule that recomputes `recomputed` (forward op indices) and saves the rest of what
    the backward needs. Without `recompute_at`, each value is recomputed just before the first
    backward op that needs it, directly or through another recomputation: the latest point,
    which holds it for the shortest time. A value taken out of a tuple op brings the tuple op
    with it (a tuple cannot be saved). Raises ValueError, naming the op, for a decision that
    cannot run. The result is not priced: `remat.solvers.timeline.evaluate.make_schedule` adds
    its cost, FLOPs and simulated peak. `again` and `offload_at` are the richer model's (see
    the module's docstring; `Schedule`'s fields), checked here the same way."""
    ops = problem.ops
    recomputed = set(recomputed)
    pinned = problem.pinned
    again_sets = {v: set(ps) for v, ps in (again or {}).items() if ps}
    for v in sorted(recomputed | again_sets.keys(), key=repr):
        _check_recomputable(problem, v, pinned)
    recomputed |= {t for t in map(lambda v: tuple_of(problem, v), recomputed) if t is not None}
    for v in list(again_sets):  # a tensor taken out of a tuple comes with its tuple op
        t = tuple_of(problem, v)
        if t is not None:
            again_sets.setdefault(t, set()).update(again_sets[v])

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
        positions = latest_positions(problem, recomputed, readers)
    else:
        positions = dict(recompute_at)
        _check_positions(problem, recomputed, positions, readers)
    again_positions = {v: tuple(sorted(ps)) for v, ps in sorted(again_sets.items())}
    _check_again(problem, again_positions, recomputed, positions)
    offloads = dict(offload_at or {})
    _check_offloads(problem, offloads, saved, positions, again_positions)
    return Schedule(saved=frozenset(saved), recomputed=frozenset(recomputed),
                    recompute_at=MappingProxyType(positions),
                    again=MappingProxyType(again_positions),
                    offload_at=MappingProxyType(offloads))


def _check_recomputable(problem: Problem, v, pinned) -> None:
    if not (isinstance(v, int) and 0 <= v < problem.num_forward):
        raise ValueError(f"cannot recompute {v!r}: not a forward op of the problem")
    op = problem.ops[v]
    if op.kind is Kind.VIEW:
        raise ValueError(f"cannot recompute view {op.name!r}: views are rebuilt from their "
                         "base; recompute the base")
    reason = recompute_blocker(problem, v)
    if reason is not None:
        raise ValueError(f"cannot recompute {op.name!r}: it is not recomputable ({reason.value})")
    if problem.root[v] in pinned:
        raise ValueError(f"cannot recompute {op.name!r}: it is an output, kept to the end")


def _check_again(problem: Problem, again: dict[int, tuple[int, ...]], recomputed: set[int],
                 positions: Mapping[int, int]) -> None:
    """Forward positions come after the value's own op; backward ones after its first backward
    recomputation (a value that is saved is never recomputed in the backward)."""
    ops, nf = problem.ops, problem.num_forward
    for v, ps in again.items():
        for p in ps:
            if not (isinstance(p, int) and v < p < len(ops)):
                raise ValueError(f"{ops[v].name!r} is recomputed again at {p!r}, which is not "
                                 "an op after it")
            if p >= nf and (v not in recomputed or p <= positions[v]):
                raise ValueError(f"{ops[v].name!r} is recomputed again before backward op "
                                 f"{ops[p].name!r}, which is not after its first backward "
                                 "recomputation")
        t = tuple_of(problem, v)
        if t is not None and not set(ps) <= set(again.get(t, ())):
            raise ValueError(f"{ops[v].name!r} must be recomputed again where its tuple op "
                             f"{ops[t].name!r} is")


def _check_offloads(problem: Problem, offloads: dict[int, int], saved: set[int],
                    positions: Mapping[int, int], again: Mapping[int, tuple[int, ...]]) -> None:
    """An offloaded value is a saved tensor, loaded back before its first backward read."""
    ops, nf = problem.ops, problem.num_forward
    if offloads and not problem.host_bandwidth:
        raise ValueError("the schedule offloads, but the problem has no host_bandwidth to cost "
                         "the transfers: lower it with the device's host link")
    for v, b in offloads.items():
        if v not in saved or ops[v].kind is not Kind.TENSOR or not ops[v].size:
            name = ops[v].name if isinstance(v, int) and 0 <= v < nf else v
            raise ValueError(f"cannot offload {name!r}: only a saved tensor that owns bytes can "
                             "be offloaded")
        if problem.root[v] in problem.pinned:
            raise ValueError(f"cannot offload {ops[v].name!r}: it is an output, kept on the "
                             "device to the step's end")
        if not (isinstance(b, int) and nf <= b < len(ops)):
            raise ValueError(f"{ops[v].name!r} is loaded back at {b!r}, which is not a "
                             "backward op")
        for r in problem.storage_readers[v]:
            reads = [r] if r >= nf else [positions[r]] if r in positions else []
            reads += [p for p in again.get(r, ()) if p >= nf]
            if any(q < b for q in reads):
                raise ValueError(f"{ops[v].name!r} is loaded back before {ops[b].name!r}, "
                                 f"after {ops[r].name!r} needs it")


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


def latest_positions(problem: Problem, recomputed: set[int],
                      readers: tuple[tuple[int, ...], ...],
                      placed: Mapping[int, int] | None = None) -> dict[int, int]:
    """Each of `recomputed` just before the first backward op that needs it, directly or
    through another recomputation: those of `placed` (value -> position) stay where they are,
    and are returned with the rest."""
    nf = problem.num_forward
    pos: dict[int, int] = dict(placed or {})
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
