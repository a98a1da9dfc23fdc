"""A plan that peaks above its budget, made to fit by recomputing more where it peaks: the
repair of the plans read off the bound's relaxation (`remat.solvers.relaxation.relaxed`), which
leave out the room that recomputations take when their own backward runs."""
from __future__ import annotations

import logging
from typing import Callable

from remat.solvers.baselines.standard import unit_cost
from remat.solvers.core.deadline import Deadline, modelled
from remat.solvers.core.problem import Kind, Problem
from remat.solvers.relaxation.second_runs import position_of
from remat.solvers.core.schedule import Schedule, drop_unneeded, recomputable
from remat.solvers.timeline.evaluate import make_schedule
from remat.solvers.timeline.simulate import StepKind, holds, step_order, timeline_of

__all__ = ["repair"]

logger = logging.getLogger(__name__)

# Each turn recomputes values that free this many times the plan's excess at its peak step.
REPAIR_OVERSHOOT = 1.1
# At most this many turns (evaluations): the peak moves as values go.
REPAIR_TURNS = 12
# The trim of what the turns added gets this share of the time left.
TRIM_SHARE = 0.1


# A rich-space move applied to each plan the cover or the trim makes (`repair_again.settle`:
# second recomputations where the plan peaks), or none (the single space).
Settle = Callable[[Schedule], Schedule]


def _as_is(schedule: Schedule) -> Schedule:
    return schedule


def repair(problem: Problem, schedule: Schedule, budget: int,
           deadline: Deadline, settle: Settle = _as_is) -> Schedule | None:
    """`schedule` made to fit (`_cover`), then without the recomputations it added that fitting
    turned out not to need, most costly first (`_trim`): each turn covers REPAIR_OVERSHOOT times
    the excess, greedily, and a later turn may free what an earlier one did (the 70B's plan over
    its two steps: 0.1988 s covered, 0.1969 trimmed). `settle` (the rich space's) goes over
    every plan made, the first too."""
    fitted = _cover(problem, schedule, budget, deadline, settle)
    if fitted is None or fitted is schedule:
        return fitted
    # A share of the time left: the evaluations are slow on large graphs under load (the
    # 70B's 27 values: 10 s at a load of 9), where a joint relaxation may be worth more.
    return _trim(problem, fitted, set(schedule.recomputed), budget,
                 deadline.within(TRIM_SHARE * deadline.left()), settle)


def _trim(problem: Problem, schedule: Schedule, kept: set[int], budget: int,
          deadline: Deadline, settle: Settle) -> Schedule:
    """`schedule` (which fits) without each recomputation not in `kept` that it can do
    without, most costly first, until the deadline."""
    evaluation = modelled("evaluation", len(problem))
    added = sorted(set(schedule.recomputed) - kept, key=lambda v: (-problem.ops[v].cost, v))
    for v in added:
        if v not in schedule.recomputed or problem.ops[v].kind is Kind.TUPLE:
            continue  # gone with an earlier one; a tuple op goes with its getitems
        if not deadline.check("repairing a relaxation's plan"):
            break
        deadline.charge(evaluation)
        try:
            trial = make_schedule(problem, drop_unneeded(problem, set(schedule.recomputed) - {v}),
                                  strategy=schedule.strategy, budget=budget)
        except ValueError:  # e.g. a getitem saved while its tuple op stays recomputed
            continue
        trial = settle(trial)
        if trial.peak <= budget and trial.cost < schedule.cost and kept <= trial.recomputed:
            schedule = trial
    return schedule


def _cover(problem: Problem, schedule: Schedule, budget: int,
           deadline: Deadline, settle: Settle) -> Schedule | None:
    """`schedule` made to fit by recomputing more where it peaks (None: it did not fit, for want
    of candidates, turns or time). At the peak step, a saved value live there whose every need
    (its backward readers, the recomputations that read it) comes after the step frees its
    bytes there when recomputed, less those of its saved inputs that must then live past the
    step; the values that free most per cost go first, as many as cover REPAIR_OVERSHOOT times
    the excess (one alone when that does not lower the peak). A relaxation's plan that peaks a
    little above the budget fits this way in a few evaluations, where another solve of the
    relaxation takes seconds (the 70B's two steps: 10 s)."""
    candidates = set(recomputable(problem))
    evaluation = modelled("evaluation", len(problem))
    one = False  # the last batch did not lower the peak: try the best value alone
    schedule = settle(schedule)
    for _ in range(REPAIR_TURNS):
        if schedule.peak <= budget:
            return schedule
        if not deadline.check("repairing a relaxation's plan"):
            return None
        peak = _peak_step(problem, schedule)
        if peak is None:
            return None
        b, live = peak
        found = _freeing(problem, schedule, candidates, b, live)
        chosen = _chosen(found[:1] if one else found, REPAIR_OVERSHOOT * (schedule.peak - budget))
        if not chosen:
            logger.debug("repair at step %d: %d over, no candidates among %d live", b,
                         schedule.peak - budget, len(live))
            return None
        deadline.charge(evaluation)
        try:
            trial = make_schedule(problem, drop_unneeded(problem, set(schedule.recomputed)
                                                         | set(chosen)),
                                  strategy="relaxation", budget=budget)
        except ValueError:
            return None
        trial = settle(trial)
        logger.debug("repair at step %d: %d over, recomputing %d more -> %d over, cost %.6g",
                     b, schedule.peak - budget, len(chosen), trial.peak - budget, trial.cost)
        if trial.peak >= schedule.peak:
            if one:
                return None
            one = True
            continue
        schedule, one = trial, False
    return schedule if schedule.peak <= budget else None


def _peak_step(problem: Problem, schedule: Schedule) -> tuple[int, set[int]] | None:
    """The backward op at whose step `schedule` peaks (a recomputation's: the op it precedes)
    and the values live there; None where it peaks in the forward."""
    order = step_order(problem, schedule)
    held = holds(problem, schedule, order)
    steps = timeline_of(problem, order, held).steps
    t = max(range(len(steps)), key=lambda i: steps[i].live)
    b = position_of(order, t) if order[t][1] is not StepKind.FORWARD else None
    if b is None or b < problem.num_forward:
        return None
    return b, {v for v, _, made, last in held if made <= t <= last}


def _freeing(problem: Problem, schedule: Schedule, candidates: set[int], b: int,
             live: set[int]) -> list[tuple[float, int, set[int], int]]:
    """The saved values live at step `b` that recomputing would free there (every need after
    it), each as (cost per byte freed, value, its group, bytes freed; `_group`), the best
    first."""
    found = []
    for v in live:
        if v in candidates and v not in schedule.recomputed and _need(problem, schedule, v) > b:
            members, frees = _group(problem, schedule, candidates, b, live, v)
            if frees > 0:
                cost = sum(unit_cost(problem, u) for u in members)
                found.append((cost / frees, v, members, frees))
    found.sort(key=lambda f: f[:2])
    return found


def _need(problem: Problem, schedule: Schedule, v: int) -> int:
    """The first step that needs `v`: its first backward reader or recomputed reader's run."""
    nf, readers, at = problem.num_forward, problem.storage_readers, schedule.recompute_at
    return min([r for r in readers[v] if r >= nf]
               + [at[r] for r in readers[v] if r < nf and r in at], default=-1)


def _group(problem: Problem, schedule: Schedule, candidates: set[int], b: int, live: set[int],
           v: int) -> tuple[set[int], int]:
    """`v` and the saved inputs it would keep past step `b`, recomputed with it (recursively);
    and the bytes that recomputing them all frees at the step: `v`'s, less what must live past
    it that did not (an input recomputed before it)."""
    nf, ops, inputs = problem.num_forward, problem.ops, problem.storage_inputs
    at = schedule.recompute_at
    members, frees, frontier = {v}, ops[v].size, [v]
    while frontier:
        for s in inputs[frontier.pop()]:
            if s >= nf or s in members or s in live or s in problem.pinned:
                continue
            if s in schedule.recomputed:
                if at.get(s, b + 1) <= b:
                    frees -= ops[s].size
            elif s in candidates:
                members.add(s)
                frontier.append(s)
            else:
                frees -= ops[s].size
    return members, frees


def _chosen(found: list[tuple[float, int, set[int], int]], excess: float) -> set[int]:
    """The groups of `found`, in order, until they free `excess` bytes."""
    chosen: set[int] = set()
    for _, v, members, frees in found:
        if excess <= 0:
            break
        if v not in chosen:
            chosen |= members
            excess -= frees
    return chosen
