"""The further runs of the rich model (`rich_model.RichModel`): which forward ops may run
again, how often, and where, each run an optional copy (`Copy`) with its own position, used as
a prefix in order of position (symmetry breaking). A tuple op runs as often as its tensors
need, each tensor taken out at some of its runs."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ortools.sat.python import cp_model

from remat.solvers.core.problem import Kind, Problem, recompute_blocker, tuple_of


@dataclass
class Copy:
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


class Runs:
    """Adds the further runs to CP-SAT model `m`: `further[v]`, the optional runs of each
    forward op v that may run again (`made` left to the caller, which owns the time axis), and
    `moved[v]`, the literal "v's first backward run is a free one" where v has one."""

    def __init__(self, m: cp_model.CpModel, problem: Problem, max_copies: int,
                 tick: Callable[[], None]):
        """Which forward ops may run again, and how often: `max_copies` further copies
        (Schedule.again) beside a first backward one; a tuple op as often as its tensors
        together, each tensor at some of its tuple's positions (make_schedule's rule)."""
        self.m, self.problem, self.max_copies = m, problem, max_copies
        ops, nf, n = problem.ops, problem.num_forward, len(problem)
        candidates = set(problem.candidates)
        self.further: dict[int, list[Copy]] = {}
        self.moved: dict[int, cp_model.IntVar] = {}  # v's first backward run is a free one
        for v in range(nf):
            tick()
            if not self._may_run(v) or tuple_of(problem, v) is not None:
                continue
            if ops[v].kind is Kind.TUPLE:
                outs = [g for g in problem.users[v] if self._may_run(g)]
                needed = any(g in candidates for g in outs)
                count = (max_copies + needed) * len(outs)
            else:
                needed = v in candidates
                count = max_copies + needed
            if count and v + 1 <= (n - 1 if needed else nf - 1):
                self.further[v] = self._runs(v, count, needed)
        for g in range(nf):
            t = tuple_of(problem, g)
            if t in self.further and self._may_run(g):
                self.further[g] = self._runs_of_tuple(g, t, g in candidates)
        self._tuples_run_for_their_tensors()

    def _may_run(self, v: int) -> bool:
        """Whether forward op v may run again: recomputable, a storage of its own, not pinned,
        not a zero-byte tensor (saving one holds nothing), and used."""
        problem, op, readers = self.problem, self.problem.ops[v], self.problem.storage_readers
        return (recompute_blocker(problem, v) is None and problem.root[v] == v
                and v not in problem.pinned and not (op.kind is Kind.TENSOR and op.size == 0)
                and bool(problem.users[v] or readers[v]))  # a forward output is read too

    def _runs(self, v: int, count: int, needed: bool) -> list[Copy]:
        """`count` optional runs of v, a prefix in order of position; in the backward only
        where the backward may need v."""
        m, nf, n = self.m, self.problem.num_forward, len(self.problem)
        low, high = v + 1, n - 1 if needed else nf - 1
        copies: list[Copy] = []
        for j in range(count):
            a = m.NewBoolVar(f"a{v}_{j}")
            b = m.NewBoolVar(f"b{v}_{j}") if needed else m.NewConstant(0)
            pos = m.NewIntVar(low, high, f"p{v}_{j}")
            copies.append(Copy(made=None, active=a, backward=b, pos=pos, low=low, high=high,
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
            self._at_most(v, copies)
        return copies

    def _runs_of_tuple(self, g: int, t: int, needed: bool) -> list[Copy]:
        """The runs of a tensor taken out of tuple op t: one optional copy per run of t, at its
        position; its first backward copy at t's first (make_schedule: a recomputed getitem's
        `recompute_at` is its tuple's)."""
        m = self.m
        copies: list[Copy] = []
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
            copies.append(Copy(made=None, active=a, backward=b, pos=c.pos, low=c.low, high=c.high,
                               free=needed and c.free, shared=True))
        moved = self._at_most(g, copies)
        theirs = self.further[t]
        for k, c in enumerate(copies):
            if theirs[k].free and moved is not None:
                earlier = [theirs[k - 1].backward] if k else []
                m.AddBoolOr(earlier + [c.active]).OnlyEnforceIf([theirs[k].backward, moved])
        return copies

    def _at_most(self, v: int, copies: list[Copy]):
        """At most `max_copies` runs besides the first backward one; that one's literal."""
        m = self.m
        if not any(c.free for c in copies):
            m.Add(sum(c.active for c in copies) <= self.max_copies)
            return None
        moved = self.moved[v] = m.NewBoolVar(f"r{v}")
        m.AddMaxEquality(moved, [c.backward for c in copies])
        m.Add(sum(c.active for c in copies) <= self.max_copies + moved)
        return moved

    def _tuples_run_for_their_tensors(self) -> None:
        """A tuple op runs again only for a tensor of it: each of its runs takes one out."""
        m, problem = self.m, self.problem
        for t in self.further:
            if problem.ops[t].kind is Kind.TUPLE:
                for k, c in enumerate(self.further[t]):
                    outs = [self.further[g][k].active for g in problem.users[t]
                            if g in self.further]
                    m.AddBoolOr(outs).OnlyEnforceIf(c.active)
