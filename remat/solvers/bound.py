"""Lower bounds that no schedule can beat, proven from what backward steps must hold.

The exact solver's own bound stays near zero on real graphs (gaps near 100 % on the peers
benchmark's FLOPs objective), even where its plan is optimal or nearly so. This module proves
bounds from a relaxation of DESIGN.md's execution model instead.

Take a backward op `b`. While it runs, the simulator holds, whatever the schedule:
- what no schedule decides: backward values made before `b` and read at or after it, outputs,
  `b`'s own output and temp bytes (`fixed_bytes`);
- some set L of forward storages (saved, or recomputed earlier and still held).
Every forward storage that `b` or a later backward op reads is in L or is recomputed after `b`,
and then so is every forward storage that recomputation reads: a storage recomputed after `b`
reads values that are live at `b` or recomputed after it themselves. What `b` reads is in L.

So a schedule that fits a budget gives a pair (L, A) with those closure rules, L's bytes at most
the budget minus `fixed_bytes[b]`, and a cost of at least A's (each value is recomputed at most
once; what is recomputed before `b` is not counted). The least such cost, a knapsack with
closure constraints that CP-SAT solves exactly in a second, bounds every schedule's cost; the
least such L bounds every schedule's peak.

Several steps together bound tighter: one decision per value, saved (S) or recomputed (R) once
in the whole step, ties their pairs. A saved value is in L at every step up to its last backward
reader; one recomputed after a step is recomputed after every earlier step; one in L and
recomputed was recomputed before, so not after. On a chain the single steps miss a layer's
recomputation (the one before the step); the joint model does not.

Both are bounds of the model, with the ops in their traced order: no checkpointing that runs the
backward in autograd's order (torch.utils.checkpoint's does) can beat them.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

from ortools.sat.python import cp_model

from remat.solvers.problem import Kind, Problem, recompute_blocker
from remat.solvers.schedule import Schedule
from remat.solvers.simulate import holds

__all__ = ["Bound", "Relaxation", "fixed_bytes", "peak_bound", "recompute_bound"]

# Backward steps tried, besides the first backward op and any the caller names: those that hold
# the most whatever the schedule, where the room left for forward values is least.
STEPS = 8
# Backward steps the joint model adds, evenly spread, besides those tried alone.
SPREAD = 16
# CP-SAT workers for the relaxations when the caller names none. At 8 the portfolio runs the
# subsolvers that prove these knapsacks at once (Llama stack, one step: 0.06 s); at 2 or 4
# workers the same proof takes 15 s or does not end within 20.
WORKERS = 8
# Costs become integers in this fraction of their total, rounded down, so that the integer
# bound stays a bound of the real costs (the rounding loses at most ops x this share).
COST_RESOLUTION = 1e-9


@dataclass(frozen=True)
class Bound:
    """`value` is proven: no schedule does better (math.inf: no schedule fits at all).

    `steps` are the backward ops whose steps prove it; `exact` says whether that relaxation was
    solved to optimality (else `value` is CP-SAT's bound of it, still a bound)."""

    value: float
    steps: tuple[int, ...]
    exact: bool

    def where(self, problem: Problem) -> str:
        if len(self.steps) == 1:
            return problem.ops[self.steps[0]].name
        return f"{len(self.steps)} backward steps together"


def fixed_bytes(problem: Problem) -> list[int]:
    """For each backward op (index - num_forward), the bytes its step holds under every schedule:
    backward values, outputs and its temp bytes; forward storages that are not outputs aside."""
    nf = problem.num_forward
    nothing = Schedule(saved=frozenset(), recomputed=frozenset(), recompute_at={})
    delta = [0] * (len(problem.ops) + 1)
    pinned = problem.pinned
    # With nothing recomputed, step t runs op t; backward storages and outputs hold the same
    # ops under every schedule, only their step numbers shift.
    for storage, size, start, stop in holds(problem, nothing):
        if storage >= nf or storage in pinned:
            delta[start] += size
            delta[stop + 1] -= size
    level, fixed = 0, []
    for t, op in enumerate(problem.ops):
        level += delta[t]
        if t >= nf:
            fixed.append(level + op.temp)
    return fixed


def recompute_bound(problem: Problem, budget: int, *, time_limit: float = 10.0,
                    steps: Iterable[int] = (), cost: Callable | None = None,
                    workers: int = 0, rich: bool = False) -> Bound:
    """A lower bound on the recompute cost (`Op.cost`, or `cost(op)`) of every schedule whose
    simulated activation peak is at most `budget`; math.inf when none can fit. `steps` adds
    backward ops to try (the peak step of a known schedule is a good one). `rich`: a bound over
    the richer execution model too (`Schedule.again`, `offload_at`; `Relaxation`'s `rich`)."""
    cost = cost or (lambda op: op.cost)
    nf = problem.num_forward
    fixed = fixed_bytes(problem)
    steps = [b for b in steps if nf <= b < len(problem.ops)]
    tried = _steps(problem, fixed, steps)
    for b in tried:
        if budget < fixed[b - nf]:
            return Bound(math.inf, (b,), True)

    def least_cost(relaxation: "Relaxation", seconds: float) -> tuple[float, bool]:
        rooms = {b: budget - fixed[b - nf] for b in relaxation.keep}
        return relaxation.least_cost(rooms, cost, seconds, workers)

    return _best(problem, tried, least_cost, time_limit, pairs=list(steps), rich=rich)


def peak_bound(problem: Problem, *, time_limit: float = 10.0, steps: Iterable[int] = (),
               workers: int = 0) -> Bound:
    """A lower bound on the simulated activation peak of every schedule, in bytes."""
    nf = problem.num_forward
    fixed = fixed_bytes(problem)

    def least_peak(relaxation: "Relaxation", seconds: float) -> tuple[float, bool]:
        return relaxation.least_peak({b: fixed[b - nf] for b in relaxation.keep}, seconds,
                                     workers)

    return _best(problem, _steps(problem, fixed, steps), least_peak, time_limit)


def _best(problem: Problem, tried: list[int], solve: Callable, time_limit: float,
          pairs: Sequence[int] = (), rich: bool = False) -> Bound:
    """The best bound `solve(relaxation, seconds)` proves: the first backward step with each of
    `pairs`; each of `tried` alone, with half the time left, in two turns (first an equal share
    each; then the steps that did not prove their optimum share what the quick ones left: on
    the 7B demo most steps prove in 0.01 s, and the one that binds needs 0.6 s); then the joint
    model over them and steps spread over the backward. Building a relaxation takes time too
    (0.2 s a step at 10,000 ops): a step is tried only when the time left exceeds what the last
    one took to build, and the joint model only when it exceeds that many times its steps, so
    the whole stays within `time_limit`."""
    deadline = time.perf_counter() + time_limit
    best = Bound(0.0, (), True)
    # First, the first backward step with each step the caller named (where a known plan
    # binds), with two thirds of the time: on a stack of blocks the first step alone misses the
    # room the top block's recomputations need when its backward runs; the pair does not
    # (2,000 ops: 11.80 -> 12.07 ms in 1.5 s).
    first = problem.num_forward
    pairs = [b for b in pairs if b != first]
    build = 0.0  # seconds the last relaxation took to build
    for i, b in enumerate(pairs):
        left = deadline - time_limit / 3 - time.perf_counter()
        if left <= 2 * build:
            break
        began = time.perf_counter()
        relaxation = Relaxation(problem, [first, b], rich)
        build = time.perf_counter() - began
        value, exact = solve(relaxation, left / (len(pairs) - i) - build)
        if value > best.value or not best.steps:
            best = Bound(value, (first, b), exact)
        if value == math.inf:
            return best
    pending = list(tried)
    for _ in range(2):
        unproven = []
        for i, b in enumerate(pending):
            left = (deadline - time.perf_counter()) / 2
            if left <= build:
                break
            began = time.perf_counter()
            relaxation = Relaxation(problem, [b], rich)
            build = time.perf_counter() - began
            value, exact = solve(relaxation, left / (len(pending) - i) - build)
            if value > best.value or not best.steps:
                best = Bound(value, (b,), exact)
            if value == math.inf:
                return best
            if not exact:
                unproven.append(b)
        pending = unproven
    joint = _spread(problem, tried)
    if len(joint) > 1 and deadline - time.perf_counter() > 2 * build * len(joint):
        relaxation = Relaxation(problem, joint, rich)
        value, exact = solve(relaxation, deadline - time.perf_counter())
        if value > best.value:
            best = Bound(value, tuple(joint), exact)
    return best


def _steps(problem: Problem, fixed: Sequence[int], extra: Iterable[int]) -> list[int]:
    nf = problem.num_forward
    if nf == len(problem.ops):
        return []
    # What the op itself reads must be live: a cheap floor of its step beside the fixed bytes.
    reads = [sum(problem.ops[s].size for s in problem.storage_inputs[b] if s < nf)
             for b in problem.backward]
    heaviest = sorted(problem.backward, key=lambda b: -(fixed[b - nf] + reads[b - nf]))
    chosen = [nf, *(b for b in extra if nf <= b < len(problem.ops)), *heaviest[:STEPS]]
    return list(dict.fromkeys(chosen))


def _spread(problem: Problem, tried: list[int]) -> list[int]:
    """`tried` and up to SPREAD more backward ops, evenly among those that read forward values
    (one per layer's backward, on a stack of SPREAD layers or fewer)."""
    nf = problem.num_forward
    readers = [b for b in problem.backward if any(s < nf for s in problem.storage_inputs[b])]
    picked = [readers[i * len(readers) // SPREAD] for i in range(min(SPREAD, len(readers)))]
    return sorted(set(tried) | set(picked))


class Relaxation:
    """The joint model over backward ops `steps`: per forward storage that the backward may
    need, save[v] or recompute[v] once; per step b, keep[b, v] (v live at b's step) and
    after[b, v] (v recomputed after it). `rich`: valid over the richer execution model too
    (recomputing twice, within the forward, offloading where the problem has a host link)."""

    def __init__(self, problem: Problem, steps: Sequence[int], rich: bool = False):
        nf = problem.num_forward
        pinned = problem.pinned
        inputs = problem.storage_inputs

        def forward(storages):  # outputs are always held: fixed bytes, never decided
            return [s for s in storages if s < nf and s not in pinned]

        def closure(start) -> list[int]:
            reach, frontier = set(), list(start)
            while frontier:
                v = frontier.pop()
                if v not in reach:
                    reach.add(v)
                    frontier.extend(forward(inputs[v]))
            return sorted(reach)

        m = cp_model.CpModel()
        self.model, self.problem = m, problem
        # One step alone needs no whole-step decision: what it recomputes after it is its cost.
        # (Solved without that layer, real graphs' single steps prove in a second, not 20.)
        joint = len(steps) > 1
        self.redo: dict[int, cp_model.IntVar] = {}
        save: dict[int, cp_model.IntVar] = {}
        bandwidth = problem.host_bandwidth if rich else None

        def offloadable(v: int) -> bool:
            op = problem.ops[v]
            return bool(bandwidth) and op.kind is Kind.TENSOR and op.size > 0

        # The richer model (`rich`): save[v] means no backward recomputation and no load; a
        # value loaded from host (off[v]) is not held between its last forward reader and its
        # load, at no cost (its transfers may be hidden); one recomputed in the backward may be recomputed again,
        # so at a step it may be both held and recomputed after it, for a second run's cost.
        off: dict[int, cp_model.IntVar] = {}
        self.off: dict[int, tuple[cp_model.IntVar, float]] = {}
        twice: dict[int, cp_model.IntVar] = {}
        if joint:
            read_by_backward = {s for r in problem.backward for s in forward(inputs[r])}
            values = closure(read_by_backward)
            last_read = {v: max((r for r in problem.storage_readers[v] if r >= nf), default=-1)
                         for v in values}
            for v in values:
                # A tuple op holds no storage of its own: what is live of it are its getitems.
                tuple_op = problem.ops[v].kind is Kind.TUPLE
                save[v] = m.NewConstant(0) if tuple_op else m.NewBoolVar(f"s{v}")
                self.redo[v] = (m.NewBoolVar(f"r{v}") if recompute_blocker(problem, v) is None
                                else m.NewConstant(0))
                if offloadable(v):
                    off[v] = m.NewBoolVar(f"o{v}")
                    # Its transfers may run wholly under compute (remat.solvers.overlap):
                    # what the step waits for them is bounded by nothing above 0.
                    self.off[v] = (off[v], 0.0)
                if rich and recompute_blocker(problem, v) is None:
                    twice[v] = m.NewBoolVar(f"t{v}")
                m.Add(save[v] + self.redo[v] + off.get(v, 0) <= 1)
            for v in read_by_backward:
                m.AddBoolOr([save[v], self.redo[v], *([off[v]] if v in off else [])])
            for u in values:
                for s in forward(inputs[u]):
                    m.Add(save[s] + self.redo[s] + off.get(s, 0) >= self.redo[u])

        self.keep: dict[int, dict[int, cp_model.IntVar]] = {}
        earlier: dict[int, cp_model.IntVar] | None = None
        for b in sorted(steps):
            ahead = {s for r in range(b, len(problem.ops)) for s in forward(inputs[r])}
            keep, after = {}, {}
            for v in closure(ahead):
                tuple_op = problem.ops[v].kind is Kind.TUPLE
                keep[v] = m.NewConstant(0) if tuple_op else m.NewBoolVar(f"k{b}_{v}")
                after[v] = (m.NewBoolVar(f"a{b}_{v}") if recompute_blocker(problem, v) is None
                            else m.NewConstant(0))
                if not joint:
                    continue
                if rich:
                    m.Add(keep[v] <= save[v] + self.redo[v] + off.get(v, 0))
                    if v in twice:  # held from one backward run, recomputed after: two runs
                        m.Add(twice[v] >= keep[v] + after[v] - 1)
                else:
                    m.Add(keep[v] + after[v] <= save[v] + self.redo[v])
                m.AddImplication(after[v], self.redo[v])
                if last_read[v] >= b:  # a saved value lives to its last reader
                    m.AddImplication(save[v], keep[v])
                if earlier is not None:  # recomputed after b: after every earlier step too
                    m.AddImplication(after[v], earlier[v])
            if not joint:  # a saved tensor loaded back from host after b: not held at b
                off = {v: m.NewBoolVar(f"o{b}_{v}") for v in keep if offloadable(v)}
                self.off = {v: (x, 0.0) for v, x in off.items()}  # free, at the least
                for v, x in off.items():
                    m.Add(x + after[v] <= 1)  # an offloaded value is saved, never recomputed
            for v in ahead:
                m.AddBoolOr([keep[v], after[v], *([off[v]] if v in off else [])])
            for s in forward(inputs[b]):
                m.Add(keep[s] == 1)
            for u in after:
                for s in forward(inputs[u]):
                    m.Add(keep[s] + after[s] + (off[s] if s in off else 0) >= after[u])
            self.keep[b], earlier = keep, after
        if not joint:  # the step's own recomputations after it are all there is to pay
            self.redo = earlier or {}
        self.twice = twice

    def _bytes(self, b: int):
        ops = self.problem.ops
        return sum(ops[v].size * k for v, k in self.keep[b].items() if ops[v].size)

    def least_cost(self, rooms: dict[int, int], cost: Callable, seconds: float,
                   workers: int, gap: float = 0.0) -> tuple[float, bool]:
        """The least cost (a bound: CP-SAT's best bound of it), and whether it is proven; the
        search may stop once its solution is within `gap` (relative) of that bound."""
        ops = self.problem.ops
        for b, room in rooms.items():
            if self.keep[b]:
                self.model.Add(self._bytes(b) <= room)
        terms = [(self.redo[v], cost(ops[v])) for v in self.redo]
        terms += [(x, cost(ops[v])) for v, x in self.twice.items()]
        terms += list(self.off.values())
        total = sum(w for _, w in terms)
        if total <= 0:
            return self._solve(1.0, seconds, workers, costless=True)
        unit = total * COST_RESOLUTION
        self.model.Minimize(sum(math.floor(w / unit) * x for x, w in terms if w >= unit))
        return self._solve(unit, seconds, workers, gap=gap)

    def least_peak(self, fixed: dict[int, int], seconds: float,
                   workers: int) -> tuple[float, bool]:
        """The least, over the model's choices, of the most that any of the steps holds."""
        top = sum(op.size for op in self.problem.ops) + max(fixed.values())
        peak = self.model.NewIntVar(0, top, "peak")
        for b, held in fixed.items():
            self.model.Add(held + self._bytes(b) <= peak)
        self.model.Minimize(peak)
        return self._solve(1, seconds, workers)

    def recomputed(self) -> set[int] | None:
        """What the last solve's solution recomputes (None: it found no solution)."""
        if self._status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            return None
        return {v for v, x in self.redo.items()
                if not isinstance(x, int) and self._solver.Value(x)}

    def _solve(self, unit: float, seconds: float, workers: int,
               costless: bool = False, gap: float = 0.0) -> tuple[float, bool]:
        solver = self._solver = cp_model.CpSolver()
        solver.parameters.max_time_in_seconds = max(seconds, 0.05)
        solver.parameters.num_workers = workers or WORKERS
        solver.parameters.relative_gap_limit = gap
        status = self._status = solver.Solve(self.model)
        if status == cp_model.INFEASIBLE:
            return math.inf, True
        if costless:
            return 0.0, status in (cp_model.OPTIMAL, cp_model.FEASIBLE)
        if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            # No solution in the time given, but what the search proved still bounds it
            # (a minimization's best bound; -inf or nan when it proved nothing).
            proved = solver.BestObjectiveBound()
            if not math.isfinite(proved) or proved <= 0:
                return 0.0, False
            return math.ceil(proved - 1e-6) * (1 if unit == 1 else unit * (1 - 1e-12)), False
        # The objective is an integer: its bound rounds up, less float noise (448.00000000000006);
        # back in seconds, the product rounds down by more than a float's error, so that it
        # stays at most the true least cost (each weight was rounded down already).
        units = math.ceil(solver.BestObjectiveBound() - 1e-6)
        value = units if unit == 1 else units * unit * (1 - 1e-12)  # bytes: exact integers
        return value, status == cp_model.OPTIMAL and not gap
