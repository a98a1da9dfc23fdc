"""Second backward runs where a plan peaks: the rich space's part of the repair
(`remat.solvers.relaxation.repair`). A value recomputed for its first backward reader is held from
there to its last; where that hold is what peaks, running it once more just before the next reader
after the peak (`Schedule.again`) frees its bytes in between, for one more run of the op. Mamba at
60 % of its save-all peak: the relaxation's plan recomputes `mul_22` (372 KB) before op 348 and
holds it to its reader at 361, 366 KB over at op 353; run again before 361, it fits.
"""
from __future__ import annotations

import logging

from remat.solvers.core.deadline import Deadline, modelled
from remat.solvers.core.problem import Problem
from remat.solvers.core.schedule import Schedule
from remat.solvers.timeline.evaluate import make_schedule
from remat.solvers.timeline.simulate import StepKind, copies_of, holds, step_order, timeline_of

__all__ = ["settle", "position_of"]

logger = logging.getLogger(__name__)

# At most this many turns (each adds the move that lowers the peak most), and this many moves
# evaluated in a turn (the largest holds first).
AGAIN_TURNS = 16
AGAIN_TRIES = 12


def position_of(order: list[tuple[int, StepKind]], t: int) -> int:
    """The op that step `t` of `order` runs before (itself, for a forward or backward op's
    step): recomputations and loads placed before an op run just before it."""
    while order[t][1] in (StepKind.RECOMPUTE, StepKind.RELOAD):
        t += 1
    return order[t][0]


def settle(problem: Problem, schedule: Schedule, budget: int, deadline: Deadline) -> Schedule:
    """`schedule` with further backward runs added while it peaks above `budget` and a run
    lowers its peak: each turn takes, of the moves at the peak step (`_moves`), the cheapest
    that fits, else the one that lowers the peak most. Returns `schedule` itself when no move
    helps; the result may still peak above the budget (a caller's cover recomputes more)."""
    evaluation = modelled("evaluation", len(problem))
    for _ in range(AGAIN_TURNS):
        if schedule.peak <= budget:
            break
        best = None
        for again in _moves(problem, schedule)[:AGAIN_TRIES]:
            if not deadline.check("adding second recomputations"):
                return schedule
            deadline.charge(evaluation)
            try:
                trial = make_schedule(problem, schedule.recomputed,
                                      recompute_at=schedule.recompute_at, again=again,
                                      offload_at=schedule.offload_at,
                                      strategy=schedule.strategy, budget=budget)
            except ValueError:  # e.g. an input's copy the run needs is not there to read
                continue
            if trial.peak >= schedule.peak:
                continue
            key = (trial.peak > budget, trial.cost if trial.peak <= budget else trial.peak)
            if best is None or key < best[0]:
                best = (key, trial)
        if best is None:
            break
        logger.debug("again: %d over -> %d over, cost %.6g", schedule.peak - budget,
                     best[1].peak - budget, best[1].cost)
        schedule = best[1]
    return schedule


def _moves(problem: Problem, schedule: Schedule) -> list[dict[int, tuple[int, ...]]]:
    """The `again` maps to try at the step where `schedule` peaks, largest hold first: each
    recomputed value whose copy is live across that step, read before it and after it, run
    again before its first reader after it; and the same with the recomputed inputs whose own
    copies would otherwise be held to that run (their backward copies read before the step),
    run there too."""
    nf = problem.num_forward
    order = step_order(problem, schedule)
    held = holds(problem, schedule, order)
    steps = timeline_of(problem, order, held).steps
    t = max(range(len(steps)), key=lambda i: steps[i].live)
    copies = copies_of(problem, schedule, order)
    at, again = schedule.recompute_at, schedule.again

    def latest_before(u: int, p_step: int):
        found = [c for c in copies.get(u, ()) if c.made < p_step]
        return found[-1] if found else None

    moves = []
    for v in schedule.recomputed:
        for c in copies.get(v, ()):
            if c.kind is not StepKind.RECOMPUTE or not c.made < t < c.last:
                continue
            later = [r for r in c.reads if r > t]
            if not later or len(later) == len(c.reads):
                continue
            r = later[0]
            p = position_of(order, r)
            if p < nf or p <= at[v] or p in again.get(v, ()):
                continue
            single = _with(again, {v: p})
            moves.append((-problem.ops[v].size, v, 0, single))
            # Inputs recomputed in the backward whose copy there would be held on to this run.
            group, frontier = {v}, [v]
            while frontier:
                for u in problem.storage_inputs[frontier.pop()]:
                    if u >= nf or u in group or u not in schedule.recomputed:
                        continue
                    cu = latest_before(u, r)
                    if cu is not None and cu.kind is StepKind.RECOMPUTE and cu.last < r \
                            and p > at[u]:
                        group.add(u)
                        frontier.append(u)
            if len(group) > 1:
                moves.append((-problem.ops[v].size, v, 1, _with(again, {u: p for u in group})))
    moves.sort(key=lambda m: m[:3])
    return [m[3] for m in moves]


def _with(again, added: dict[int, int]) -> dict[int, tuple[int, ...]]:
    out = {v: tuple(ps) for v, ps in again.items()}
    for v, p in added.items():
        out[v] = tuple(sorted(set(out.get(v, ())) | {p}))
    return out
