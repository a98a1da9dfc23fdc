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
from remat.solvers.cpsat.rich_runs import Copy, Runs
from remat.solvers.cpsat.units import Profile, Units
from remat.solvers.core.deadline import Deadline, ticker
from remat.solvers.core.problem import Kind, Problem, tuple_of
from remat.solvers.core.schedule import Schedule


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
        self._tick = ticker(deadline, "building the rich model")
        self.width = problem.num_forward + 2
        self.horizon = self.op_time(len(problem) - 1) + 1
        m = self.model = cp_model.CpModel()
        self._size, self._temp = units.sizes(problem)
        runs = Runs(m, problem, max_copies, self._tick)
        self.further, self.moved = runs.further, runs.moved
        self._first: dict[int, cp_model.IntVar] = {}  # `_first_after`'s answers, by tuple op
        self._here: dict[int, list] = {}  # and the runs each may be
        self._made_times()
        self._loads(offload)
        intervals, demands = [], []
        fixed = Profile()
        served = self._storage_copies(self._reads_of_runs(), fixed, intervals, demands)
        self._run_temps(intervals, demands)
        # Offloads: their transfers timed against the compute, soundly (rich_offload).
        self.transfers = Transfers(self, served) if self.load else None
        self.fixed_peak = fixed.add_to(m, intervals, demands)
        self.peak = m.NewIntVar(self.fixed_peak, max(sum(demands), self.fixed_peak), "peak")
        m.AddCumulative(intervals, demands, self.peak)
        self._objective()

    def _made_times(self) -> None:
        """Each further run's `made`, the slot its copy exists from: its recomputation's, or
        for a getitem's tensor the step after its tuple's."""
        for v, copies in self.further.items():
            t = tuple_of(self.problem, v)
            for c in copies:
                c.made = (self.rec_time(c.pos, v) if t is None
                          else self.rec_time(c.pos, t) + 1)

    def _loads(self, offload: bool) -> None:
        """Loads from host: a saved tensor's backward reads, served by one load (`load[u]`, a
        copy at a chosen backward position). `offloads`: whether the model offloads at all."""
        m, problem, ops = self.model, self.problem, self.problem.ops
        nf, n = problem.num_forward, len(problem)
        self.load: dict[int, Copy] = {}
        loadable = [u for u in sorted(problem.candidates) if ops[u].kind is Kind.TENSOR
                    and ops[u].size and u not in problem.pinned]
        if offload and len(loadable) > MAX_LOADS:
            offload = False  # the pairwise orders of the copy streams would not scale
        self.offloads = offload
        if offload:
            for u in loadable:
                off = m.NewBoolVar(f"off{u}")
                at = m.NewIntVar(nf, n - 1, f"load{u}")
                m.Add(at == nf).OnlyEnforceIf(off.Not())
                self.load[u] = Copy(made=at * self.width, active=off,
                                    backward=m.NewConstant(1), pos=at)
                for c in self.further.get(u, ()):
                    m.AddImplication(off, c.backward.Not())  # a saved value only

    # --- The reads of every storage that a decision touches, and its copies.

    def _reads_of_runs(self) -> dict[int, list[_Read]]:
        """The reads of forward storages by the further runs of their readers."""
        nf = self.problem.num_forward
        reads: dict[int, list[_Read]] = {}
        for r, copies in self.further.items():
            for s in self.problem.storage_inputs[r]:
                if s < nf:
                    reads.setdefault(s, []).extend(_Read(self.rec_time(c.pos, r), c.active,
                                                         c.backward, c.pos) for c in copies)
        return reads

    def _storage_copies(self, reads: dict[int, list[_Read]], fixed: Profile, intervals: list,
                        demands: list[int]) -> dict[int, list[_Read]]:
        """The copies of every storage that a decision touches (`storages`), their reads
        (`reads`, keys for hints) each served by one (`x`); every other storage, and every
        temp, held in `fixed`. Returns each decided storage's reads, as `_serve` took them."""
        problem, size, temp = self.problem, self._size, self._temp
        readers, nf = problem.storage_readers, problem.num_forward
        self.x: dict[tuple[int, int, int], cp_model.IntVar] = {}  # (storage, read, copy)
        self.storages: dict[int, list[Copy]] = {}
        self.reads: dict[int, list[tuple]] = {}  # the key of each read, for hints
        served: dict[int, list[_Read]] = {}  # every read of a decided storage, as `_serve`s
        hold = fixed.hold
        for i, op in enumerate(problem.ops):
            self._tick()
            hold(temp[i], self.op_time(i), self.op_time(i))
            if problem.root[i] != i or not size[i]:
                continue
            t = tuple_of(problem, i)
            made = self.op_time(i) if t is None else self.op_time(t) + 1
            if i in problem.pinned:
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
            served[i] = self._decided_storage(i, made, bare, reads.get(i, []), intervals,
                                              demands)
        return served

    def _decided_storage(self, i: int, made: int, bare: bool, run_reads: list[_Read],
                         intervals: list, demands: list[int]) -> list[_Read]:
        """Storage i's copies (the original, its further runs, its load), each read served by
        one, each copy an interval of i's size from its `made` to its end. Returns i's reads."""
        m = self.model
        copies = [Copy(made=made), *self.further.get(i, ())]
        if i in self.load:
            copies.append(self.load[i])
        keys, all_reads = self._reads_of(i, run_reads)
        self.storages[i], self.reads[i] = copies, keys
        for k, c in enumerate(copies):
            c.end = m.NewIntVar(0, self.horizon - 1, f"e{i}_{k}")
        self._serve(i, copies, all_reads)
        if bare:
            m.Add(copies[0].end >= self._first_after(tuple_of(self.problem, i)))
        for k, c in enumerate(copies):
            length = c.length = m.NewIntVar(1, self.horizon, f"l{i}_{k}")
            if c.active is None:
                m.Add(c.end >= made)
                intervals.append(m.NewIntervalVar(made, length, c.end + 1, f"c{i}_{k}"))
            else:
                intervals.append(m.NewOptionalIntervalVar(c.made, length, c.end + 1,
                                                          c.active, f"c{i}_{k}"))
            demands.append(self._size[i])
        return all_reads

    def _reads_of(self, i: int, run_reads: list[_Read]) -> tuple[list[tuple], list[_Read]]:
        """Every read of storage i: its readers' own runs, then their further runs'; each
        keyed (reader, None) or (reader, run) for hints."""
        problem, nf = self.problem, self.problem.num_forward
        readers = problem.storage_readers[i]
        keys = [(r, None) for r in readers]
        all_reads = [_Read(self.op_time(r), None, r >= nf, r) for r in readers]
        for r, copies_r in self.further.items():
            if i in problem.storage_inputs[r]:
                keys.extend((r, j) for j in range(len(copies_r)))
        return keys, all_reads + run_reads

    def _run_temps(self, intervals: list, demands: list[int]) -> None:
        """Each further run's temp, at the step it runs."""
        m, temp = self.model, self._temp
        for v, copies in self.further.items():
            for c in copies:
                if temp[v]:
                    intervals.append(m.NewOptionalFixedSizeIntervalVar(
                        self.rec_time(c.pos, v), 1, c.active, f"t{v}_{c.pos.Name()}"))
                    demands.append(temp[v])

    def _objective(self) -> None:
        """`cost`: the further runs' costs, and what the step may wait for the transfers
        (bounded above, rich_offload); `terms`: how many of the terms round down."""
        ops, units = self.problem.ops, self.units
        terms = [(c.active, units.cost_of(ops[v].cost))
                 for v, copies in self.further.items() for c in copies]
        self.terms = len(terms)  # each rounds down by less than a unit
        # What the step may wait for the transfers: bounded above (rich_offload).
        terms += [(late, 1) for late in (self.transfers.terms() if self.transfers else ())]
        self.cost = cp_model.LinearExpr.WeightedSum([x for x, _ in terms], [w for _, w in terms])

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

    def _serve(self, u: int, copies: list[Copy], reads: list[_Read]) -> None:
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
