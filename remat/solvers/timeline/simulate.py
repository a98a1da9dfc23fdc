"""Replay a training step under a schedule and report its memory timeline.

This is the judge of every plan: the solvers' claimed peaks must equal it and the rewritten
step's measured live bytes must match it. It implements the execution model of
docs/execution-model.md and nothing else:

- The step is a sequence of steps: every forward op; then, for each backward op, the
  recomputations placed before it (in forward order) followed by the op itself.
- A storage is live from the step that makes it to the last step that reads it, both included
  (an op's inputs and output are live together while it runs). A storage nobody reads dies at
  its own step. Views read their base's storage and own nothing.
- A forward storage that the schedule saves lives until its last reader in the forward or the
  backward (recomputations included). Any other forward storage dies after its last forward
  reader; a recomputed one lives again from its recomputation to its last backward reader.
- Outputs (and the bases of output views) live to the end of the step.
- A recomputed copy of a value that a compiled step fuses into its readers
  (`Problem.fused_recomputations`) that serves one op holds no bytes; that op reads its inputs
  instead, so their storages live to it. Serving two, it is a buffer: Inductor computes a
  value read by two kernels once where it is costly (an exp, a sigmoid) and fuses it into
  both, which then run together at the later one's place.
- An op's `temp` bytes are live during its step only. A tuple op's temp is all its outputs;
  a tensor taken out of it (a getitem) is live from the step after the tuple op's.

The richer model (`Schedule.again`, `Schedule.offload_at`) adds copies: a recomputation within
the forward (placed before a forward op, in forward order), a further one in the backward, a
load from host memory (before the recomputations placed at the same backward op; it holds the
value's bytes from its issue). The device copy that an offloaded value is copied to host from
lives until that copy ends, in the timeline of `remat.solvers.timeline.overlap`. In general a
forward storage has a list of copies, each made at a step, and every read is served by the
latest copy made before it; a copy lives from the step that makes it to the last read it
serves. Without further copies this is exactly the rule above: the saved copy serves the
backward, the original serves the forward, a recomputed copy the backward after it.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from functools import cached_property

from remat.solvers.core.problem import Kind, Problem, tuple_of
from remat.solvers.core.schedule import Schedule
from remat.solvers.timeline.overlap import transfers
from remat.solvers.timeline.steps import StepKind

__all__ = ["Copy", "Step", "StepKind", "Timeline", "copies_of", "holds", "simulate",
           "step_order", "steps_of", "timeline_of"]


@dataclass(frozen=True)
class Copy:
    """One copy of a forward storage: the step that makes it and the steps of the reads it
    serves (sorted); it lives from `made` to its last read."""

    made: int
    kind: StepKind
    reads: tuple[int, ...]
    # The copy an offloaded value is copied to host from lives on while that copy runs, past
    # its last read (`remat.solvers.timeline.overlap`): to this step. -1: to its last read.
    until: int = -1
    # A recomputation fused into the one op it serves: no bytes (the module's rules).
    fused: bool = False

    @property
    def last(self) -> int:
        return max(self.reads[-1] if self.reads else self.made, self.until)


@dataclass(frozen=True)
class Step:
    op: int
    kind: StepKind
    live: int  # bytes live while this step runs


@dataclass(frozen=True)
class Timeline:
    """The bytes live at each step of `order` (`step_order`'s), `lives[t]` at step t. The
    `Step` objects are made only when asked for: most callers read the peak alone, and making
    a step object each took most of a timeline's time (Gemma-2-9B's eager timeline: 60 of 70
    ms for its 15,914 steps)."""

    order: tuple[tuple[int, StepKind], ...]
    lives: tuple[int, ...]

    @cached_property
    def steps(self) -> tuple[Step, ...]:
        return tuple(Step(op=i, kind=kind, live=live)
                     for (i, kind), live in zip(self.order, self.lives))

    @property
    def peak(self) -> int:
        return max(self.lives, default=0)

    @property
    def peak_step(self) -> Step | None:
        if not self.lives:
            return None
        t = max(range(len(self.lives)), key=self.lives.__getitem__)  # the first of the highest
        return self.steps[t]


def step_order(problem: Problem, schedule: Schedule) -> list[tuple[int, StepKind]]:
    """The (op, kind) of every step in the order the step runs them: before each op, the loads
    from host placed there, then the recomputations placed there in forward order."""
    nf = problem.num_forward
    before: dict[int, list[int]] = {}
    for v, b in schedule.recompute_at.items():
        before.setdefault(b, []).append(v)
    for v, positions in schedule.again.items():
        for p in positions:
            before.setdefault(p, []).append(v)
    reload: dict[int, list[int]] = {}
    for v, b in schedule.offload_at.items():
        reload.setdefault(b, []).append(v)
    order = []
    for i in range(len(problem.ops)):
        order.extend((v, StepKind.RELOAD) for v in sorted(reload.get(i, ())))
        order.extend((v, StepKind.RECOMPUTE) for v in sorted(before.get(i, ())))
        order.append((i, StepKind.FORWARD if i < nf else StepKind.BACKWARD))
    return order


def holds(problem: Problem, schedule: Schedule,
          order: list[tuple[int, StepKind]] | None = None) -> list[tuple[int, int, int, int]]:
    """Every (storage, bytes, first step, last step) that the step holds under `schedule`, steps
    counted in `order` (step_order's): outputs and backward values once, a forward storage
    once per copy (`copies_of`)."""
    order = step_order(problem, schedule) if order is None else order
    held = [(i, problem.ops[i].size, made, last) for i, made, last in _fixed_holds(problem, order)]
    for v, copies in copies_of(problem, schedule, order).items():
        held.extend((v, 0 if c.fused else problem.ops[v].size, c.made, c.last) for c in copies)
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
    lives = []
    for t, (i, kind) in enumerate(order):
        live += delta[t]
        # A load from host is a copy into the value's own bytes: no kernel scratch of the op's.
        lives.append(live + (ops[i].temp if kind is not StepKind.RELOAD else 0))
    return Timeline(tuple(order), tuple(lives))


def steps_of(order, num_ops: int) -> tuple[list[int], dict[int, int]]:
    """Where each op's value is made in `order` (`step_order`'s): forward and backward ops
    once, at the first list's step; a recomputed op again, at the dict's step."""
    first_step = [0] * num_ops
    recompute_step: dict[int, int] = {}
    for t, (i, kind) in enumerate(order):
        if kind is StepKind.RECOMPUTE:
            recompute_step[i] = t
        elif kind is not StepKind.RELOAD:  # a load makes no op's value
            first_step[i] = t
    return first_step, recompute_step


def _fixed_holds(problem: Problem, order) -> list[tuple[int, int, int]]:
    """(storage, first step, last step) of what no schedule decides: outputs and backward
    values. Forward storages are `copies_of`'s."""
    first_step, _ = steps_of(order, len(problem.ops))
    end = len(order) - 1
    held = []
    for i in range(problem.num_forward, len(problem.ops)):
        if problem.root[i] != i or problem.ops[i].size == 0 or i in problem.pinned:
            continue
        t = tuple_of(problem, i)
        made = first_step[i] if t is None else first_step[t] + 1
        held.append((i, made, max((first_step[r] for r in problem.storage_readers[i]),
                                  default=made)))
    for i in problem.pinned:
        if problem.ops[i].size:
            t = tuple_of(problem, i)
            held.append((i, first_step[i] if t is None else first_step[t] + 1, end))
    return held


def copies_of(problem: Problem, schedule: Schedule,
              order: list[tuple[int, StepKind]] | None = None) -> dict[int, list[Copy]]:
    """Every copy of every forward storage that owns bytes (outputs aside), in the order they
    are made, each with the reads it serves: every read goes to the latest copy made before it.
    A load from host is a copy too; the copy it replaces serves only the reads before it."""
    ops, nf = problem.ops, problem.num_forward
    order = step_order(problem, schedule) if order is None else order
    made: dict[int, list[tuple[int, StepKind]]] = {}
    reads: dict[int, list[int]] = {}
    tuple_ran: dict[int, int] = {}  # a tuple op's latest step
    end_of_forward = 0
    for t, (i, kind) in enumerate(order):
        if kind is StepKind.RELOAD:  # reads host memory, not a device storage
            made.setdefault(i, []).append((t, kind))
            continue
        if i < nf:
            if kind is StepKind.FORWARD:
                end_of_forward = t
            if ops[i].kind is Kind.TUPLE:
                tuple_ran[i] = t
            tp = tuple_of(problem, i)
            # A getitem's tensor exists from the step after its tuple op's run.
            made.setdefault(i, []).append((t if tp is None else tuple_ran[tp] + 1, kind))
        for s in problem.storage_inputs[i]:
            if s < nf:
                reads.setdefault(s, []).append(t)
    for i, op in enumerate(ops):  # a forward output is read when the forward returns
        if op.forward_output:
            reads.setdefault(problem.root[i], []).append(end_of_forward)
    fused = _read_through_fused(problem, schedule, made, reads)
    result: dict[int, list[Copy]] = {}
    for v in range(nf):
        if problem.root[v] != v or ops[v].size == 0 or v in problem.pinned:
            continue
        steps = sorted(made[v])
        served: list[list[int]] = [[] for _ in steps]
        starts = [s for s, _ in steps]
        for r in sorted(reads.get(v, ())):
            k = bisect.bisect_left(starts, r) - 1
            if k < 0:
                raise ValueError(f"{ops[v].name!r} is read at step {r} before any copy of it")
            served[k].append(r)
        result[v] = [Copy(s, kind, tuple(rs), fused=v in fused and kind is StepKind.RECOMPUTE)
                     for (s, kind), rs in zip(steps, served)]
    if schedule.offload_at:
        _until_copied(problem, schedule, order, result)
    return result


def _read_through_fused(problem: Problem, schedule: Schedule, made: dict, reads: dict
                       ) -> set[int]:
    """The values whose recomputed copy is fused (the module's rules): the one recomputation
    of a `Problem.fused_recomputations` value (neither run again nor loaded) serving one op.
    That op reads the value's input storages instead of the recomputation (a fused input's in
    turn: later values first)."""
    free = problem.fused_recomputations
    fused: set[int] = set()
    if not free:
        return fused
    nf = problem.num_forward
    for v in sorted(free.intersection(schedule.recompute_at), reverse=True):
        if v in schedule.again or v in schedule.offload_at:
            continue
        recomputed = max(t for t, kind in made[v] if kind is StepKind.RECOMPUTE)
        served = {r for r in reads.get(v, ()) if r > recomputed}
        if len(served) != 1:
            continue
        fused.add(v)
        for s in problem.storage_inputs[v]:
            if s < nf:
                reads[s].remove(recomputed)
                reads[s].extend(served)
    return fused


def _until_copied(problem: Problem, schedule: Schedule, order, copies: dict[int, list[Copy]]
                  ) -> None:
    """Each offloaded value's device copy, the one copied to host, lives until that copy ends
    (`remat.solvers.timeline.overlap`'s timeline)."""
    for v, transfer in transfers(problem, schedule, order).by_value.items():
        found = copies[v]
        k = max(k for k, c in enumerate(found) if c.made <= transfer.issued_after)
        found[k] = Copy(found[k].made, found[k].kind, found[k].reads, until=transfer.released)
