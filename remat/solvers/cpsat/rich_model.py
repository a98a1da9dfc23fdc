"""The CP-SAT model of the richer execution model (`SolverOptions.model` "rich").

Per forward op v that may run again, up to `max_copies` further copies (`Schedule.again`)
beside a first backward recomputation, each an optional run with its own position (the op it
runs before: a forward op after v, or a backward op where the backward may need v), used as a
prefix in order of position (symmetry breaking). A tuple op runs as often as its tensors need,
each tensor taken out at some of its runs. Per saved tensor, where the problem has a host
link, an optional load from host at a chosen backward position, its transfers timed against
the compute by `rich_offload` (an upper bound of what the step waits for, and device copies
held at least as long as they live). Every read of a forward
storage (its forward and backward readers, and every run of a reader) is assigned to the copy
`simulate` serves it from: the latest made before it; a value recomputed in the backward or
loaded serves no backward read from a forward copy (make_schedule's rules). Each copy is an
optional interval from the step that makes it to an end at least its reads; one cumulative
constraint bounds the memory. O(n * copies) variables, plus the reads' assignments.

Exactness, the free model's argument: with tight ends, the model's profile is simulate's for
the same copies; ends are only bounded below, and looser ends only overstate memory, so the
least cost is exact, and the least peak at that cost (the driver's second stage) is
simulate's. Without offload the model spans the whole rich space of `max_copies` (what
`tests.oracles.rich_brute` enumerates), so CP-SAT's bound holds over it; with offload its
transfers are bounded, not exact (`rich_offload`), and its bound holds over nothing but
itself.

Time: op i owns a block of nf + 2 slots starting at i * (nf + 2): slot 0 for loads from host,
slot 1 + v for a recomputation of forward op v placed before i, slot nf + 1 for op i itself
(`simulate.step_order`'s order).
"""
from __future__ import annotations

from dataclasses import dataclass

from ortools.sat.python import cp_model

from remat.solvers.cpsat.rich_hint import hint
from remat.solvers.cpsat.rich_offload import MAX_LOADS, Transfers
from remat.solvers.cpsat.units import Profile, Units
from remat.solvers.core.deadline import Deadline, ticker
from remat.solvers.core.problem import Kind, Problem, recompute_blocker, tuple_of
from remat.solvers.core.schedule import Schedule


@dataclass
class _Copy:
    """One copy of a forward value in the model: made at `made`, live to `end`; `active`,
    `backward` (placed before a backward op) and `pos` are None for the original."""

    made: object
    active: object = None
    backward: object = None
    pos: object = None
    end: object = None
    length: object = None
    low: int = 0  # the least position (an inactive copy's)
    high: int = 0  # the greatest
    free: bool = False  # `backward` is a variable of its own
    shared: bool = False  # `pos` is the tuple op's run's


@dataclass
class _Read:
    time: object  # the slot of the read
    active: object = None  # the literal that makes the read happen (None: always)
    backward: object = False  # True, or a literal: the read is in the backward
    pos: object = None  # the op it runs at or before (an index, or a position variable)


class RichModel:
    """The richer model without capacity or objective (the stages add those): `cost`, `peak`,
    `fixed_peak`, `terms` (how many cost terms round down), `decision`, `hint`."""

    def __init__(self, problem: Problem, units: Units, max_copies: int, offload: bool,
                 deadline: Deadline | None = None):
        """OutOfTime when `deadline` passes while the model is built."""
        self.problem, self.units = problem, units
        tick = ticker(deadline, "building the rich model")
        ops, nf, n = problem.ops, problem.num_forward, len(problem)
        self.width = nf + 2
        self.horizon = self.op_time(n - 1) + 1
        m = self.model = cp_model.CpModel()
        size, temp = units.sizes(problem)
        pinned, root, readers = problem.pinned, problem.root, problem.storage_readers
        candidates = set(problem.candidates)

        # --- Which forward ops may run again, and how often: `max_copies` further copies
        # (Schedule.again) beside a first backward one; a tuple op as often as its tensors
        # together, each tensor at some of its tuple's positions (make_schedule's rule).
        def may_run(v: int) -> bool:
            op = ops[v]
            return (recompute_blocker(problem, v) is None and root[v] == v and v not in pinned
                    and not (op.kind is Kind.TENSOR and op.size == 0)
                    and bool(problem.users[v] or readers[v]))  # a forward output is read too

        self.further: dict[int, list[_Copy]] = {}
        self._first: dict[int, cp_model.IntVar] = {}
        self.moved: dict[int, cp_model.IntVar] = {}  # v's first backward run is a free one
        self._here: dict[int, list] = {}
        for v in range(nf):
            tick()
            if not may_run(v) or tuple_of(problem, v) is not None:
                continue
            if ops[v].kind is Kind.TUPLE:
                outs = [g for g in problem.users[v] if may_run(g)]
                needed = any(g in candidates for g in outs)
                count = (max_copies + needed) * len(outs)
            else:
                needed = v in candidates
                count = max_copies + needed
            if count and v + 1 <= (n - 1 if needed else nf - 1):
                self.further[v] = self._runs(v, count, needed, max_copies)
        for g in range(nf):
            t = tuple_of(problem, g)
            if t in self.further and may_run(g):
                self.further[g] = self._runs_of_tuple(g, t, g in candidates, max_copies)
        for t in self.further:
            if ops[t].kind is Kind.TUPLE:  # the tuple runs again only for a tensor of it
                for k, c in enumerate(self.further[t]):
                    outs = [self.further[g][k].active for g in problem.users[t]
                            if g in self.further]
                    m.AddBoolOr(outs).OnlyEnforceIf(c.active)
        for v, copies in self.further.items():
            t = tuple_of(problem, v)
            for c in copies:  # a getitem's tensor exists from the step after its tuple's
                c.made = (self.rec_time(c.pos, v) if t is None
                          else self.rec_time(c.pos, t) + 1)

        # --- Loads from host: a saved tensor's backward reads, served by one load.
        self.load: dict[int, _Copy] = {}
        loadable = [u for u in sorted(candidates) if ops[u].kind is Kind.TENSOR and ops[u].size
                    and u not in pinned]
        if offload and len(loadable) > MAX_LOADS:
            offload = False  # the pairwise orders of the copy streams would not scale
        self.offloads = offload
        if offload:
            for u in loadable:
                off = m.NewBoolVar(f"off{u}")
                at = m.NewIntVar(nf, n - 1, f"load{u}")
                m.Add(at == nf).OnlyEnforceIf(off.Not())
                self.load[u] = _Copy(made=at * self.width, active=off,
                                     backward=m.NewConstant(1), pos=at)
                for c in self.further.get(u, ()):
                    m.AddImplication(off, c.backward.Not())  # a saved value only

        # --- The reads of every storage that a decision touches.
        reads: dict[int, list[_Read]] = {}
        for r, copies in self.further.items():
            for s in problem.storage_inputs[r]:
                if s < nf:
                    reads.setdefault(s, []).extend(_Read(self.rec_time(c.pos, r), c.active,
                                                         c.backward, c.pos) for c in copies)
        self.x: dict[tuple[int, int, int], cp_model.IntVar] = {}  # (storage, read, copy)
        self.storages: dict[int, list[_Copy]] = {}
        self.reads: dict[int, list[tuple]] = {}  # the key of each read, for hints
        served: dict[int, list[_Read]] = {}  # every read of a decided storage, as `_serve`s
        intervals, demands = [], []
        fixed = Profile()
        hold = fixed.hold
        for i, op in enumerate(ops):
            tick()
            hold(temp[i], self.op_time(i), self.op_time(i))
            if root[i] != i or not size[i]:
                continue
            t = tuple_of(problem, i)
            made = self.op_time(i) if t is None else self.op_time(t) + 1
            if i in pinned:
                hold(size[i], made, self.horizon - 1)
                continue
            last = max((self.op_time(r) for r in readers[i]), default=made)
            # A getitem's tensor that no read may hold lives at the step after its tuple op's
            # (simulate), which a recomputation placed there may be: `_first_after`.
            bare = t is not None and (i in self.further or not readers[i])
            if i >= nf or (i not in reads and i not in self.further and i not in self.load
                           and not bare):
                hold(size[i], made, last)  # nothing decided about it
                continue
            copies = [_Copy(made=made), *self.further.get(i, ())]
            if i in self.load:
                copies.append(self.load[i])
            keys = [(r, None) for r in readers[i]]
            all_reads = [_Read(self.op_time(r), None, r >= nf, r) for r in readers[i]]
            for r, copies_r in self.further.items():
                if i in problem.storage_inputs[r]:
                    keys.extend((r, j) for j in range(len(copies_r)))
            all_reads += reads.get(i, [])
            self.storages[i], self.reads[i] = copies, keys
            served[i] = all_reads
            for k, c in enumerate(copies):
                c.end = m.NewIntVar(0, self.horizon - 1, f"e{i}_{k}")
            self._serve(i, copies, all_reads)
            if bare:
                m.Add(copies[0].end >= self._first_after(t))
            for k, c in enumerate(copies):
                length = c.length = m.NewIntVar(1, self.horizon, f"l{i}_{k}")
                if c.active is None:
                    m.Add(c.end >= made)
                    intervals.append(m.NewIntervalVar(made, length, c.end + 1, f"c{i}_{k}"))
                else:
                    intervals.append(m.NewOptionalIntervalVar(c.made, length, c.end + 1,
                                                              c.active, f"c{i}_{k}"))
                demands.append(size[i])
        for v, copies in self.further.items():
            for c in copies:
                if temp[v]:
                    intervals.append(m.NewOptionalFixedSizeIntervalVar(
                        self.rec_time(c.pos, v), 1, c.active, f"t{v}_{c.pos.Name()}"))
                    demands.append(temp[v])

        # Offloads: their transfers timed against the compute, soundly (rich_offload).
        self.transfers = Transfers(self, served) if self.load else None

        self.fixed_peak = fixed.add_to(m, intervals, demands)
        self.peak = m.NewIntVar(self.fixed_peak, max(sum(demands), self.fixed_peak), "peak")
        m.AddCumulative(intervals, demands, self.peak)

        terms = [(c.active, units.cost_of(ops[v].cost))
                 for v, copies in self.further.items() for c in copies]
        self.terms = len(terms)  # each rounds down by less than a unit
        # What the step may wait for the transfers: bounded above (rich_offload).
        terms += [(late, 1) for late in (self.transfers.terms() if self.transfers else ())]
        self.cost = cp_model.LinearExpr.WeightedSum([x for x, _ in terms], [w for _, w in terms])

    def _runs(self, v: int, count: int, needed: bool, max_copies: int) -> list[_Copy]:
        """`count` optional runs of v, a prefix in order of position; in the backward only
        where the backward may need v."""
        m, nf, n = self.model, self.problem.num_forward, len(self.problem)
        low, high = v + 1, n - 1 if needed else nf - 1
        copies: list[_Copy] = []
        for j in range(count):
            a = m.NewBoolVar(f"a{v}_{j}")
            b = m.NewBoolVar(f"b{v}_{j}") if needed else m.NewConstant(0)
            pos = m.NewIntVar(low, high, f"p{v}_{j}")
            copies.append(_Copy(made=None, active=a, backward=b, pos=pos, low=low, high=high,
                                free=needed))
            m.Add(pos == low).OnlyEnforceIf(a.Not())
            if needed:
                m.AddImplication(b, a)
                m.Add(pos >= nf).OnlyEnforceIf(b)
                m.Add(pos <= nf - 1).OnlyEnforceIf([a, b.Not()])
            if j:  # a prefix, in order of position
                prev = copies[j - 1]
                m.AddImplication(a, prev.active)
                m.Add(pos >= prev.pos + 1).OnlyEnforceIf(a)
        if self.problem.ops[v].kind is not Kind.TUPLE:
            self._at_most(v, copies, max_copies)
        return copies

    def _runs_of_tuple(self, g: int, t: int, needed: bool, max_copies: int) -> list[_Copy]:
        """The runs of a tensor taken out of tuple op t: one optional copy per run of t, at its
        position; its first backward copy at t's first (make_schedule: a recomputed getitem's
        `recompute_at` is its tuple's)."""
        m = self.model
        copies: list[_Copy] = []
        for k, c in enumerate(self.further[t]):
            a = m.NewBoolVar(f"a{g}_{k}")
            m.AddImplication(a, c.active)
            m.Add(c.pos >= g + 1).OnlyEnforceIf(a)  # after the tensor's own op
            if needed and c.free:
                b = m.NewBoolVar(f"b{g}_{k}")
                m.AddImplication(b, a)
                m.AddImplication(b, c.backward)
                m.AddBoolOr([b]).OnlyEnforceIf([a, c.backward])
            else:
                b = m.NewConstant(0)
                if c.free:
                    m.AddImplication(a, c.backward.Not())
            copies.append(_Copy(made=None, active=a, backward=b, pos=c.pos, low=c.low, high=c.high,
                                free=needed and c.free, shared=True))
        moved = self._at_most(g, copies, max_copies)
        theirs = self.further[t]
        for k, c in enumerate(copies):
            if theirs[k].free and moved is not None:
                earlier = [theirs[k - 1].backward] if k else []
                m.AddBoolOr(earlier + [c.active]).OnlyEnforceIf([theirs[k].backward, moved])
        return copies

    def _at_most(self, v: int, copies: list[_Copy], max_copies: int):
        """At most `max_copies` runs besides the first backward one; that one's literal."""
        m = self.model
        if not any(c.free for c in copies):
            m.Add(sum(c.active for c in copies) <= max_copies)
            return None
        moved = self.moved[v] = m.NewBoolVar(f"r{v}")
        m.AddMaxEquality(moved, [c.backward for c in copies])
        m.Add(sum(c.active for c in copies) <= max_copies + moved)
        return moved

    def _first_after(self, t: int):
        """The slot of the first step after forward op t: a recomputation placed before op
        t + 1 (of an op up to t), else op t + 1 itself."""
        if t in self._first:
            return self._first[t]
        m, p = self.model, t + 1
        latest = self.op_time(p)
        slots = [latest]
        self._here[t] = []
        for v, copies in self.further.items():
            for k, c in enumerate(copies):
                if v > t or not c.low <= p <= c.high:
                    continue
                here = m.NewBoolVar(f"at{p}_{v}_{c.pos.Name()}")  # run before op t + 1
                m.Add(c.pos == p).OnlyEnforceIf(here)
                m.Add(c.pos != p).OnlyEnforceIf([here.Not(), c.active])
                m.AddImplication(here, c.active)
                slots.append(latest - (latest - self.rec_time(p, v)) * here)
                self._here[t].append((here, v, k))
        first = self._first[t] = m.NewIntVar(p * self.width + 1, latest, f"first{p}")
        m.AddMinEquality(first, slots)
        return first

    def op_time(self, i: int) -> int:
        return i * self.width + self.problem.num_forward + 1

    def rec_time(self, pos, v: int):
        return pos * self.width + 1 + v

    def _serve(self, u: int, copies: list[_Copy], reads: list[_Read]) -> None:
        """Each read to one copy made before it and live until it. A value recomputed in the
        backward or loaded from host serves no backward read from a forward copy (a schedule's
        `recompute_at` precedes every backward reader; a load serves every backward read)."""
        m = self.model
        served: list[list] = [[] for _ in copies]
        moved = [c.backward for c in self.further.get(u, ())]
        if u in self.load:
            moved.append(self.load[u].active)
        for i, read in enumerate(reads):
            options = []
            for k, c in enumerate(copies):
                if c is self.load.get(u) and read.backward is False:
                    continue  # a load comes after the whole forward
                x = m.NewBoolVar(f"x{u}_{i}_{k}")
                self.x[u, i, k] = x
                options.append(x)
                served[k].append(x)
                if c.active is not None:
                    m.AddImplication(x, c.active)
                    m.Add(c.made + 1 <= read.time).OnlyEnforceIf(x)
                m.Add(c.end >= read.time).OnlyEnforceIf(x)
                # simulate's rule: the latest copy made before the read serves it (a prefix
                # of runs: the next one is the only one to check; a tuple's tensor: each).
                later = [d for d in copies[k + 1:] if d is not self.load.get(u)]
                for d in later if later and later[0].shared else later[:1]:
                    m.Add(d.made >= read.time).OnlyEnforceIf([x, d.active])
                if read.backward is False or c is self.load.get(u):
                    continue
                # A forward copy serving a backward read: the value is neither recomputed in
                # the backward nor loaded (c itself being a backward copy aside).
                when = [x] if read.backward is True else [x, read.backward]
                for moving in moved:
                    if c.backward is not None and moving is c.backward:
                        continue
                    clause = [moving.Not()] + ([c.backward] if c.backward is not None else [])
                    m.AddBoolOr(clause).OnlyEnforceIf(when)
            m.Add(sum(options) == (1 if read.active is None else read.active))
        for c, xs in zip(copies, served):  # a further copy that serves nothing is not made
            if c.active is not None:
                m.Add(sum(xs) >= 1).OnlyEnforceIf(c.active)

    # --- Reading and hinting solutions.

    def decision(self, value) -> tuple[dict[int, list[int]], dict[int, int]]:
        """The positions of each value's further copies, and each offloaded value's load."""
        positions = {v: sorted(int(value(c.pos)) for c in copies if value(c.active))
                     for v, copies in self.further.items()}
        return ({v: ps for v, ps in positions.items() if ps},
                {u: int(value(c.pos)) for u, c in self.load.items() if value(c.active)})

    def hint(self, schedule: Schedule) -> bool:
        """Hint every variable from `schedule` (`rich_hint.hint`); False, hinting nothing,
        when the schedule is outside the model's space."""
        return hint(self, schedule)
