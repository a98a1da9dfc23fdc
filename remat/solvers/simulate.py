"""Replay a training step under a schedule and report its memory timeline.

This is the judge of every plan: the solvers' claimed peaks must equal it and the rewritten
step's measured live bytes must match it. It implements DESIGN.md's execution model and
nothing else:

- The step is a sequence of steps: every forward op; then, for each backward op, the
  recomputations placed before it (in forward order) followed by the op itself.
- A storage is live from the step that makes it to the last step that reads it, both included
  (an op's inputs and output are live together while it runs). A storage nobody reads dies at
  its own step. Views read their base's storage and own nothing.
- A forward storage that the schedule saves lives until its last reader in the forward or the
  backward (recomputations included). Any other forward storage dies after its last forward
  reader; a recomputed one lives again from its recomputation to its last backward reader.
- Outputs (and the bases of output views) live to the end of the step.
- An op's `temp` bytes are live during its step only. A tuple op's temp is all its outputs;
  a tensor taken out of it (a getitem) is live from the step after the tuple op's.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

from remat.solvers.problem import Problem, tuple_of
from remat.solvers.schedule import Schedule


class StepKind(str, enum.Enum):
    FORWARD = "forward"
    RECOMPUTE = "recompute"
    BACKWARD = "backward"


@dataclass(frozen=True)
class Step:
    op: int
    kind: StepKind
    live: int  # bytes live while this step runs


@dataclass(frozen=True)
class Timeline:
    steps: tuple[Step, ...]

    @property
    def peak(self) -> int:
        return max((s.live for s in self.steps), default=0)

    @property
    def peak_step(self) -> Step | None:
        return max(self.steps, key=lambda s: s.live, default=None)


def step_order(problem: Problem, schedule: Schedule) -> list[tuple[int, StepKind]]:
    """The (op, kind) of every step in the order the step runs them."""
    nf = problem.num_forward
    before: dict[int, list[int]] = {}
    for v, b in schedule.recompute_at.items():
        before.setdefault(b, []).append(v)
    order = [(i, StepKind.FORWARD) for i in range(nf)]
    for b in problem.backward:
        order.extend((v, StepKind.RECOMPUTE) for v in sorted(before.get(b, ())))
        order.append((b, StepKind.BACKWARD))
    return order


def holds(problem: Problem, schedule: Schedule,
          order: list[tuple[int, StepKind]] | None = None) -> list[tuple[int, int, int, int]]:
    """Every (storage, bytes, first step, last step) that the step holds under `schedule`, steps
    counted in `order` (step_order's). A recomputed storage holds twice: its original copy and
    its recomputed one."""
    ops = problem.ops
    nf = problem.num_forward
    order = step_order(problem, schedule) if order is None else order
    end = len(order) - 1
    first_step, recompute_step = steps_of(order, len(ops))

    readers = problem.storage_readers
    pinned = problem.pinned
    held = []
    for i, op in enumerate(ops):
        if problem.root[i] != i or op.size == 0:
            continue
        # A tensor taken out of a tuple op exists from the tuple op on: the tuple holds it
        # until the getitem runs, and anything placed in between runs beside it.
        t = tuple_of(problem, i)
        made = first_step[i] if t is None else first_step[t] + 1
        if i in pinned:
            held.append((i, op.size, made, end))
            continue
        # Steps at which the original and the recomputed copy are read.
        forward_reads = [first_step[r] for r in readers[i] if r < nf]
        later_reads = [first_step[r] for r in readers[i] if r >= nf]
        later_reads += [recompute_step[r] for r in readers[i] if r in recompute_step]
        if i >= nf:
            held.append((i, op.size, made, max(later_reads, default=made)))
        elif i in schedule.saved:
            held.append((i, op.size, made, max(forward_reads + later_reads, default=made)))
        else:
            held.append((i, op.size, made, max(forward_reads, default=made)))
            if i in recompute_step:
                again = recompute_step[i] if t is None else recompute_step[t] + 1
                held.append((i, op.size, again, max(later_reads, default=again)))
    return held


def simulate(problem: Problem, schedule: Schedule) -> Timeline:
    order = step_order(problem, schedule)
    return timeline_of(problem, order, holds(problem, schedule, order))


def timeline_of(problem: Problem, order: list[tuple[int, StepKind]],
                held: list[tuple[int, int, int, int]]) -> Timeline:
    """The timeline of steps `order` holding each (storage, bytes, first step, last step) of
    `held`, plus each op's temp during its own step (shared by the execution modes)."""
    ops = problem.ops
    delta = [0] * (len(order) + 1)
    for _, size, start, stop in held:
        delta[start] += size
        delta[stop + 1] -= size

    live = 0
    steps = []
    for t, (i, kind) in enumerate(order):
        live += delta[t]
        steps.append(Step(op=i, kind=kind, live=live + ops[i].temp))
    return Timeline(tuple(steps))


def steps_of(order, num_ops: int) -> tuple[list[int], dict[int, int]]:
    """Where each op's value is made in `order` (`step_order`'s): forward and backward ops
    once, at the first list's step; a recomputed op again, at the dict's step."""
    first_step = [0] * num_ops
    recompute_step: dict[int, int] = {}
    for t, (i, kind) in enumerate(order):
        if kind is StepKind.RECOMPUTE:
            recompute_step[i] = t
        else:
            first_step[i] = t
    return first_step, recompute_step
