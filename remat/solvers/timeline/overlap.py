"""Offload that overlaps compute: when each transfer to and from host memory runs, and what the
step waits for. Torch-free; one definition, used by `schedule.price` (the cost), `simulate`
(how long a device copy lives), the exhaustive search, the eager mode and the rewrite.

The timeline. The compute stream runs the steps of `simulate.step_order` in order, each for its
op's `cost` (a load from host takes no compute: its step only issues the transfer). Transfers
run on two copy streams, one per direction (device to host, host to device; the link is full
duplex, `Problem.host_bandwidth` bytes per cost unit each way). Each copy stream is a FIFO: a
transfer starts when it is issued or when the transfer before it on its stream ends, whichever
is later, and takes size / bandwidth.
- The copy of an offloaded value to host is issued when the compute stream ends the step after
  which the value is offloaded (`offload_points`: the last read of its latest forward copy, or
  its making if nothing reads it; the eager mode passes its own). The device copy lives until
  the copy ends: through every step that starts before then (`Transfer.released`). The
  compute stream waits for it only where the execution joins the copies: the compiled plan at
  the forward's end (`join_forward`; its forward graph frees every device copy before it
  returns), the eager mode nowhere (a freed copy's memory waits for the copy in the
  allocator).
- Its load back is issued when the compute stream reaches its RELOAD step (before op
  `offload_at[v]`, `simulate`'s order) and starts no earlier than the copy to host has ended.
  The first step that reads the loaded copy starts no earlier than the load has ended: the
  compute stream waits there, and that wait is what the transfers add to the step.
The step's time is when its last step ends; the exposed transfer time is that less the sum of
the steps' costs. It is 0 when every load fits under the compute between its issue and its
first reader, and never more than the transfers' own time (`link_time`): a chain of waits runs
through distinct transfers, each at most once.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Mapping, Sequence

from remat.solvers.core.problem import Problem
from remat.solvers.core.schedule import Schedule
from remat.solvers.timeline.steps import StepKind

__all__ = ["Transfer", "Transfers", "host_bytes", "offload_points", "transfers"]


@dataclass(frozen=True)
class Transfer:
    """One offloaded value's two transfers, in the units of `Op.cost` from the step's start;
    steps are indices into the step order."""

    value: int
    size: int
    issued_after: int  # the step after which the copy to host is issued
    out_start: float
    out_end: float
    released: int  # the last step that holds the device copy (the copy to host still runs)
    load_step: int  # the RELOAD step
    in_issued: float
    in_start: float
    in_end: float
    first_read: int | None  # the first step that reads the loaded copy
    wait: float  # how long the compute stream waited for this load there


@dataclass(frozen=True)
class Transfers:
    """The timeline of a schedule's transfers (module docstring)."""

    by_value: Mapping[int, Transfer]
    steps: tuple[int, ...]  # each step's op
    starts: tuple[float, ...]  # each step's start on the compute stream
    compute_time: float  # the steps' own costs
    step_time: float  # when the last step ends, waits included
    link_time: float  # every transfer's own time, both directions

    @property
    def exposed(self) -> float:
        """What the transfers add to the step: the compute stream's waits."""
        return max(0.0, self.step_time - self.compute_time)

    @property
    def hidden(self) -> float:
        """Transfer time that runs under compute."""
        return max(0.0, self.link_time - self.exposed)


def host_bytes(problem: Problem, schedule: Schedule) -> int:
    """Bytes the offloaded values hold in host memory: each its own buffer, all of them at once
    between the forward and the backward (every copy to host comes before every load back)."""
    return sum(problem.ops[v].size for v in schedule.offload_at)


def offload_points(problem: Problem, schedule: Schedule,
                   order: Sequence[tuple[int, StepKind]]) -> dict[int, int]:
    """For each offloaded value, the step after which it is copied to host: the last read of its
    latest forward copy (a recomputation within the forward makes a new one), or that copy's
    making if nothing reads it."""
    offloaded = schedule.offload_at
    last: dict[int, int] = {}
    for t, (i, kind) in enumerate(order):
        if kind in (StepKind.BACKWARD, StepKind.RELOAD):
            break  # the forward has ended: every load is in the backward
        if i in offloaded:
            last[i] = t  # made (or made again) here
        for s in problem.storage_inputs[i]:
            if s in offloaded:
                last[s] = t
    return last


def transfers(problem: Problem, schedule: Schedule, order: Sequence[tuple[int, StepKind]],
              issue_after: Mapping[int, int] | None = None,
              join_forward: bool = True) -> Transfers:
    """The transfer timeline of `schedule` on `problem`, steps in `order` (step_order's, RELOAD
    steps included). `issue_after` (value -> step) replaces `offload_points` where an execution
    issues its copies elsewhere (the eager mode: when a block's checkpoint returns);
    `join_forward`: the compute waits at the forward's end for every copy to host."""
    ops, bandwidth = problem.ops, problem.host_bandwidth
    offloaded = schedule.offload_at
    if offloaded and not bandwidth:
        raise ValueError("the schedule offloads, but the problem has no host_bandwidth to time "
                         "the transfers: lower it with the device's host link")
    after = dict(offload_points(problem, schedule, order))
    if issue_after:
        after.update({v: t for v, t in issue_after.items() if v in offloaded})
    missing = [v for v in offloaded if v not in after]
    if missing:
        raise ValueError(f"{ops[missing[0]].name!r} is offloaded but no forward step makes it")
    issued_at: dict[int, list[int]] = {}
    for v in sorted(offloaded, key=lambda v: (after[v], v)):
        issued_at.setdefault(after[v], []).append(v)
    loads = {}
    waiting: dict[int, int] = {}  # a loaded value whose first reader is yet to come
    first_read: dict[int, int] = {}
    for t, (i, kind) in enumerate(order):
        if kind is StepKind.RELOAD:
            loads[i] = t
            waiting[i] = t
            continue
        for s in problem.storage_inputs[i]:
            if s in waiting:
                first_read[s] = t
                del waiting[s]
    readers_at: dict[int, list[int]] = {}
    for v, t in first_read.items():
        readers_at.setdefault(t, []).append(v)

    now = out_free = in_free = compute = 0.0
    starts: list[float] = []
    out: dict[int, tuple[float, float]] = {}
    load: dict[int, tuple[float, float, float]] = {}
    waits: dict[int, float] = {}
    nf = problem.num_forward
    backward_begins = next((t + 1 for t, step in enumerate(order)
                            if step == (nf - 1, StepKind.FORWARD)), None) if join_forward else None
    for t, (i, kind) in enumerate(order):
        if t == backward_begins:  # once every copy to host has ended
            now = max(now, out_free)
        if kind is StepKind.RELOAD:
            starts.append(now)
            begin = max(now, in_free, out[i][1])
            in_free = begin + ops[i].size / bandwidth
            load[i] = (now, begin, in_free)
            continue
        for v in readers_at.get(t, ()):
            ready = load[v][2]
            waits[v] = max(0.0, ready - now)
            now = max(now, ready)
        starts.append(now)
        now += ops[i].cost
        compute += ops[i].cost
        for v in issued_at.get(t, ()):
            begin = max(now, out_free)
            out_free = begin + ops[v].size / bandwidth
            out[v] = (begin, out_free)
    by_value = {}
    for v in offloaded:
        if v not in load:
            raise ValueError(f"{ops[v].name!r} is offloaded but never loaded back")
        # The device copy lives through every step that starts before its copy to host ends.
        released = max(after[v], bisect.bisect_left(starts, out[v][1], lo=after[v]) - 1)
        by_value[v] = Transfer(
            value=v, size=ops[v].size, issued_after=after[v], out_start=out[v][0],
            out_end=out[v][1], released=released, load_step=loads[v], in_issued=load[v][0],
            in_start=load[v][1], in_end=load[v][2], first_read=first_read.get(v),
            wait=waits.get(v, 0.0))
    link = sum(2 * ops[v].size / bandwidth for v in offloaded) if offloaded else 0.0
    return Transfers(by_value=by_value, steps=tuple(i for i, _ in order),
                     starts=tuple(starts), compute_time=compute,
                     step_time=now, link_time=link)
