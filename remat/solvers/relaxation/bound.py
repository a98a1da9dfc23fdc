"""Lower bounds that no schedule can beat, proven from what backward steps must hold.

The exact solver's own bound stays near zero on real graphs (gaps near 100 % on the peers
benchmark's FLOPs objective), even where its plan is optimal or nearly so. This module proves
bounds from a relaxation of the execution model that `simulate` replays instead.

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
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

from remat.solvers.core.deadline import Deadline, OutOfTime
from remat.solvers.core.problem import Problem
from remat.solvers.relaxation.relaxation import COST_RESOLUTION, WORKERS, Relaxation
from remat.solvers.core.schedule import Schedule
from remat.solvers.timeline.simulate import holds

__all__ = ["COST_RESOLUTION", "WORKERS", "Bound", "Relaxation", "fixed_bytes", "peak_bound",
           "recompute_bound"]

# Backward steps tried, besides the first backward op and any the caller names: those that hold
# the most whatever the schedule, where the room left for forward values is least.
STEPS = 8
# Backward steps the joint model adds, evenly spread, besides those tried alone.
SPREAD = 16


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
                    workers: int = 0, rich: bool = False,
                    deadline: Deadline | None = None) -> Bound:
    """A lower bound on the recompute cost (`Op.cost`, or `cost(op)`) of every schedule whose
    simulated activation peak is at most `budget`; math.inf when none can fit. `steps` adds
    backward ops to try (the peak step of a known schedule is a good one). `rich`: a bound over
    the richer execution model too (`Schedule.again`, `offload_at`; `Relaxation`'s `rich`).
    Within `time_limit` seconds of `deadline` (a part of a caller's call), or of now."""
    deadline = _part(deadline, time_limit)
    if not deadline.check("proving a bound"):
        return Bound(0.0, (), False)
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

    return _best(problem, tried, least_cost, deadline, pairs=list(steps), rich=rich)


def peak_bound(problem: Problem, *, time_limit: float = 10.0, steps: Iterable[int] = (),
               workers: int = 0, deadline: Deadline | None = None, rich: bool = False) -> Bound:
    """A lower bound on the simulated activation peak of every schedule, in bytes (within
    `time_limit` seconds of `deadline`, or of now). `rich`: of every schedule of the richer
    execution model too (`Relaxation`'s `rich`); the single one's joint steps, one decision a
    value, do not bound it there (tests/solvers/test_rich_floor.py)."""
    deadline = _part(deadline, time_limit)
    if not deadline.check("proving a peak bound"):
        return Bound(0.0, (), False)
    nf = problem.num_forward
    fixed = fixed_bytes(problem)

    def least_peak(relaxation: "Relaxation", seconds: float) -> tuple[float, bool]:
        return relaxation.least_peak({b: fixed[b - nf] for b in relaxation.keep}, seconds,
                                     workers)

    return _best(problem, _steps(problem, fixed, steps), least_peak, deadline, rich=rich)


def _part(deadline: Deadline | None, seconds: float) -> Deadline:
    return Deadline(seconds) if deadline is None else deadline.within(seconds)


def _best(problem: Problem, tried: list[int], solve: Callable, deadline: Deadline,
          pairs: Sequence[int] = (), rich: bool = False) -> Bound:
    """The best bound `solve(relaxation, seconds)` proves: the first backward step with each of
    `pairs`; each of `tried` alone, with half the time left, in two turns (first an equal share
    each; then the steps that did not prove their optimum share what the quick ones left: on
    the 7B demo most steps prove in 0.01 s, and the one that binds needs 0.6 s); then the joint
    model over them and steps spread over the backward. Building a relaxation takes time too
    (0.2 s a step at 10,000 ops): a step is tried only when the time left exceeds what the last
    one took to build, and the joint model only when it exceeds that many times its steps, so
    the whole stays within `deadline`, which also stops a relaxation's build (OutOfTime: the
    best bound so far stands)."""
    found = [Bound(0.0, (), True)]  # the best so far, where OutOfTime finds it
    try:
        return _steps_in_turn(problem, tried, solve, deadline, pairs, rich, found)
    except OutOfTime:
        return found[0]


def _steps_in_turn(problem: Problem, tried: list[int], solve: Callable, deadline: Deadline,
                   pairs: Sequence[int], rich: bool, found: list[Bound]) -> Bound:
    time_limit = deadline.limit
    now = deadline.now
    best = found[0]
    # First, the first backward step with each step the caller named (where a known plan
    # binds), with two thirds of the time: on a stack of blocks the first step alone misses the
    # room the top block's recomputations need when its backward runs; the pair does not
    # (2,000 ops: 11.80 -> 12.07 ms in 1.5 s).
    first = problem.num_forward
    pairs = [b for b in pairs if b != first]
    build = 0.0  # seconds the last relaxation took to build
    for i, b in enumerate(pairs):
        left = deadline.left() - time_limit / 3
        if left <= 2 * build:
            break
        began = now()
        relaxation = Relaxation(problem, [first, b], rich, deadline)
        build = now() - began
        value, exact = solve(relaxation, left / (len(pairs) - i) - build)
        if value > best.value or not best.steps:
            best = found[0] = Bound(value, (first, b), exact)
        if value == math.inf:
            return best
    pending = list(tried)
    for _ in range(2):
        unproven = []
        for i, b in enumerate(pending):
            left = deadline.left() / 2
            if left <= build:
                break
            began = now()
            relaxation = Relaxation(problem, [b], rich, deadline)
            build = now() - began
            value, exact = solve(relaxation, left / (len(pending) - i) - build)
            if value > best.value or not best.steps:
                best = found[0] = Bound(value, (b,), exact)
            if value == math.inf:
                return best
            if not exact:
                unproven.append(b)
        pending = unproven
    joint = _spread(problem, tried)
    if len(joint) > 1 and deadline.left() > 2 * build * len(joint):
        relaxation = Relaxation(problem, joint, rich, deadline, in_order=True)
        value, exact = solve(relaxation, deadline.left())
        if value > best.value:
            best = found[0] = Bound(value, tuple(joint), exact)
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


