"""A plan read off the bound's relaxation (`remat.solvers.relaxation.bound.Relaxation`), and the
bound the same solves prove: a primal heuristic that starts next to the bound.

The relaxation at the first backward step decides, for every forward value, kept or recomputed;
recompute what it recomputes, save the rest, and the plan costs exactly the bound. It leaves out
the room those recomputations take when their own backward runs, so the plan may peak above the
budget, at the step where the top block's recomputations are live. Each such plan is repaired
where it peaks (`remat.solvers.relaxation.repair`: the 70B's two-step plan, 1.9 GB over, fits at 3 %
above the bound in 0.5 s); and, in turn:
- add that step to the relaxation (a joint model over a few steps: the bound rises, and the next
  plan knows the room the step needs), while a solve is quick beside the time left;
- then shrink the rooms by the excess until a plan fits, and bisect between the rooms that fit
  and not, keeping the cheapest plan that fits.
On synthetic transformers at half the save-all peak: 2,000 ops, 2.5 % above the bound in 4 s
(CP-SAT from the baselines: 7.9 % after 60 s); 10,000 ops, 1.3 % in 20 s.
"""
from __future__ import annotations

import logging
import math
from typing import Callable

from remat.solvers.relaxation.bound import Bound, fixed_bytes
from remat.solvers.core.deadline import Deadline, OutOfTime, modelled
from remat.solvers.relaxation.relaxation import Relaxation
from remat.solvers.core.problem import Problem
from remat.solvers.relaxation.repair import repair
from remat.solvers.relaxation.shrinks import Shrinks
from remat.solvers.core.schedule import Schedule, drop_unneeded
from remat.solvers.timeline.evaluate import make_schedule
from remat.solvers.timeline.simulate import simulate

__all__ = ["binding_step", "joint_bound", "loaded_bound", "loaded_steps", "read_plan",
           "relaxed_schedule"]

logger = logging.getLogger(__name__)

# At most this many steps in the joint relaxation; a step joins only while a solve takes less
# than this share of the time left (two steps take 2 to 3 times one step's time, three 6).
MAX_STEPS = 3
QUICK_SHARE = 0.15
# Each solve stops within this share of its optimum: the last fraction of a percent is most of
# the time to prove it (5,000 ops: 9.5 s to prove one step), and the bound is CP-SAT's anyway.
GAP = 2e-3
# The joint solve grown from `_tightest_step`, which is there for its plan (the step's own bound
# stands), stops within this share: the 70B's, 3.9 CPU seconds, the same plan; 6.7 at GAP.
PLAN_GAP = 1e-2
# Its solves get at most these shares of the time left, alone and joined: the turns from the
# first step follow (a synthetic 5,000-op stack at a load of 10: its step alone found nothing in
# 7.7 s, where the first step's plan and bound came in 2.2 s). The joined solve has most of
# what is left: where it ends within the call's relative gap, the turns are not needed (the
# 70B at a load of 5 with 20.7 s: cut at 0.6, its step's own plan stood at 2.04 %).
TIGHTEST_ALONE_SHARE = 0.3
TIGHTEST_SHARE = 0.8
# `loaded_bound` joins LOADED_FIRST steps, then LOADED_MORE more a solve, up to LOADED_MOST: a
# quick first solve, then the most that proves in a few seconds (mamba at 60 %: 8 to 16 steps
# prove 4.16e-05 in 0.2 to 0.3 s each, 20 prove 5.827e-05 in 1.3 s, 24 the same in 5 s).
LOADED_FIRST, LOADED_MORE, LOADED_MOST = 8, 12, 32


def relaxed_schedule(problem: Problem, budget: int, *, time_limit: float = 10.0,
                     workers: int = 0, lowest: list | None = None,
                     deadline: Deadline | None = None,
                     one_step: list | None = None, rich: list | None = None,
                     plans: Deadline | None = None,
                     relative_gap: float = 0.0) -> tuple[Schedule | None, Bound]:
    """The cheapest plan that fits `budget` found this way in `time_limit` seconds of
    `deadline` (a part of a caller's call) or of now (None: none), and the best bound its
    solves with the true rooms proved (math.inf: no schedule fits). `lowest`, a list, receives
    the plan of least peak seen, fitting or not (near the floor, where none fits, a start for
    the least-peak search); `one_step`, a list, the best bound proven at one step alone (the
    first, or `_tightest_step`'s, solved before it), which holds over the rich space too, where
    no value may wait in host memory.

    `rich`, a list, asks for the steps joined to be solved over the rich space
    (`Relaxation(rich=True)`, a relaxation of the single one: its bound holds over both) and
    receives the best Bound proven there. Its solution is the single space's too wherever it
    recomputes nothing twice and offloads nothing, and the plan is read off it then; else the
    same steps are solved again over the single space for the plan where a solve as long fits
    (mamba at 60 %: a plan read off the rich solution cost 7.03e-05 against 6.22e-05). One
    solve instead of two where the joint solve is most of the time (the 70B's two first steps:
    4.1 CPU seconds, where the single solve took 5.0 and the rich one 7.1 after it).

    `plans`, a part of `deadline` (None: all of it), bounds the turns that only look for
    cheaper plans (rooms shrunk); the first step's turn and the joint one may run to `deadline`,
    since their bounds are the call's. `relative_gap` (the call's; 0: none): where the tightest
    step's plan is proven within it, the turns from the first step are not taken (the 70B at
    1 %: 0.59 % at 12 s, where the turns took 11 s more and found nothing cheaper)."""
    deadline = Deadline(time_limit) if deadline is None else deadline.within(time_limit)
    found: list = [None, Bound(0.0, (), True)]  # the best plan and bound, where OutOfTime finds
    try:
        return _read_plans(problem, budget, workers, lowest, deadline, found, one_step, rich,
                           plans or deadline, relative_gap)
    except OutOfTime:
        return found[0], found[1]


def _read_plans(problem: Problem, budget: int, workers: int, lowest: list | None,
                deadline: Deadline, found: list, one_step: list | None,
                rich: list | None, plans: Deadline,
                relative_gap: float) -> tuple[Schedule | None, Bound]:
    """`relaxed_schedule`'s plan and bound: the tightest step's first (`_from_tightest`), then
    the turns from the first step (`_turns`), telling `found` as they come."""
    evaluation = modelled("evaluation", len(problem))
    nf = problem.num_forward
    proven = Bound(0.0, (), True)
    if nf == len(problem.ops):
        return None, proven
    deadline.charge(evaluation)
    fixed = fixed_bytes(problem)
    if budget < fixed[0]:  # the first backward step holds more under every schedule
        return None, Bound(math.inf, (nf,), True)
    deadline.charge(evaluation)
    best = None  # the cheapest fitting plan
    tightest = _tightest_step(problem)
    if tightest != nf:  # its bound first, alone, then with the step where its plan binds
        # `found` and `one_step` are told as soon as known: OutOfTime may end the joint solve.
        try:
            best, proven = _from_tightest(problem, budget, tightest, workers, deadline, rich,
                                          found, one_step if one_step is not None else [])
        except OutOfTime:  # its part is spent: what it found stands, the turns follow
            best, proven = found[0], found[1]
        if proven.value == math.inf:
            return None, proven
        if (relative_gap > 0 and best is not None and best.peak <= budget
                and best.cost - proven.value <= relative_gap * best.cost):
            return best, proven
    return _turns(problem, budget, fixed, workers, lowest, deadline, found, one_step, rich,
                  plans, best, proven)


def _turns(problem: Problem, budget: int, fixed: list[int], workers: int, lowest: list | None,
           deadline: Deadline, found: list, one_step: list | None, rich: list | None,
           plans: Deadline, best: Schedule | None,
           proven: Bound) -> tuple[Schedule | None, Bound]:
    """The turns from the first backward step (the module's docstring), from `best` and
    `proven` so far: the cheapest fitting plan and the best bound with the true rooms."""
    now, nf = deadline.now, problem.num_forward
    steps, shrinks = [nf], Shrinks(budget)
    overhead = 0.0  # what the last turn spent outside the solve: building, evaluating
    while True:
        shrink = shrinks.shrink
        turn = plans if shrink else deadline  # the turns whose bounds count may run longer
        if not (turn.left() > overhead and turn.check("reading a plan off the relaxation")):
            break
        began = now()
        rooms = {b: budget - fixed[b - nf] - shrink for b in steps}
        if min(rooms.values()) < 0 and not shrink:
            break
        relaxation, value, exact, built, solved = _solve_turn(
            problem, steps, rooms, turn, overhead, workers, now,
            rich if len(steps) > 1 and not shrink else None)
        if not shrink and value > proven.value or not proven.steps:
            proven = found[1] = Bound(value, tuple(steps), exact)
        if (not shrink and len(steps) == 1 and one_step is not None
                and (not one_step or value > one_step[0].value)):
            one_step[:] = [Bound(value, tuple(steps), exact)]
        if value == math.inf and shrink:
            if shrinks.after_infeasible():
                continue
            break
        schedule = None if value == math.inf else read_plan(problem, budget, relaxation,
                                                            deadline)
        if schedule is None:
            break
        overhead = built - began + now() - solved
        logger.debug("relaxation over %d steps, rooms less %d: bound %.6g, plan %.6g s peaking "
                     "%d above the budget (%.2f s)", len(steps), shrink, value, schedule.cost,
                     schedule.peak - budget, solved - built)
        best = _kept(problem, budget, schedule, best, found, lowest, deadline)
        if schedule.peak <= budget:
            shrinks.fits = shrink
            if not shrink:
                break  # the plan meets the relaxation's own optimum
        else:
            shrinks.fails = shrink
            binding = binding_step(problem, schedule)
            quick = solved - built < QUICK_SHARE * deadline.left()
            if (not shrink and quick and binding is not None and binding not in steps
                    and len(steps) < MAX_STEPS):
                steps = sorted(steps + [binding])
                continue
        if not shrinks.after_plan(schedule.peak - budget):
            break
    return best, proven


def _solve_turn(problem: Problem, steps: list[int], rooms: dict[int, int], turn: Deadline,
                overhead: float, workers: int, now: Callable[[], float],
                rich: list | None) -> tuple[Relaxation, float, bool, float, float]:
    """The relaxation over `steps` with `rooms`, its least cost and whether it is proven,
    within `turn` less `overhead`, and the clock (`now`) when it was built and when solved.
    Over the rich space where `rich`, a list, asks (which receives its bound); where the
    solution is not the single space's too and a solve as long fits, its plan may be poor:
    solved again over the single space (else the plan is read off the rich solution's
    recomputations)."""
    relaxation = Relaxation(problem, steps, rich is not None, deadline=turn)
    built = now()
    value, exact = relaxation.least_cost(rooms, lambda op: op.cost,
                                         turn.left() - overhead, workers, gap=GAP)
    solved = now()
    if rich is None:
        return relaxation, value, exact, built, solved
    logger.debug("relaxation over %d steps over the rich space: bound %.6g (%.2f s), "
                 "single: %s", len(steps), value, solved - built, relaxation.single())
    if value > 0 and (not rich or value > rich[0].value):
        rich[:] = [Bound(value, tuple(steps), exact)]
    if not relaxation.single() and solved - built < turn.left() - overhead:
        relaxation = Relaxation(problem, steps, deadline=turn)
        built = now()
        value, exact = relaxation.least_cost(rooms, lambda op: op.cost,
                                             turn.left() - overhead, workers, gap=GAP)
        solved = now()
    return relaxation, value, exact, built, solved


def _kept(problem: Problem, budget: int, schedule: Schedule, best: Schedule | None,
          found: list, lowest: list | None, deadline: Deadline) -> Schedule | None:
    """The cheapest fitting plan of `best` and `schedule` (repaired where it peaks above
    `budget`), told to `found`; `lowest` receives `schedule` where it peaks lowest yet."""
    if lowest is not None and (not lowest or schedule.peak < lowest[0].peak):
        lowest[:] = [schedule]
    if schedule.peak > budget:
        completed = repair(problem, schedule, budget, deadline)
        logger.debug("repaired: %s", completed and completed.cost)
        if completed is not None and (best is None or completed.cost < best.cost):
            best = found[0] = completed
    if schedule.peak <= budget and (best is None or schedule.cost < best.cost):
        best = found[0] = schedule
    return best


def joint_bound(problem: Problem, budget: int, steps, *, rich: bool,
                deadline: Deadline, workers: int = 0) -> Bound:
    """The bound the relaxation over `steps` together proves within `deadline` (`rich`: over
    the richer execution model, `Relaxation`'s `rich`): the steps a plan was read off, proven
    again over another space. Math.inf when no schedule fits; 0 when out of time."""
    try:
        relaxation = Relaxation(problem, steps, rich, deadline, in_order=True)
        nf, fixed = problem.num_forward, fixed_bytes(problem)
        rooms = {b: budget - fixed[b - nf] for b in relaxation.keep}
        value, exact = relaxation.least_cost(rooms, lambda op: op.cost, deadline.left(), workers,
                                             gap=GAP)
    except OutOfTime:
        return Bound(0.0, (), False)
    return Bound(value, tuple(steps), exact)


def _from_tightest(problem: Problem, budget: int, tightest: int, workers: int,
                   deadline: Deadline, rich: list | None, found: list,
                   one_step: list) -> tuple[Schedule | None, Bound]:
    """The relaxation at `tightest` alone (its bound holds over the rich space too), then with
    the step where its plan binds (over the rich space where `rich` asks, which receives its
    bound): the plan of least cost that fits (the joint one as read, else the joint and the
    lone plans repaired), and the one step's bound, both told to `found` (plan, bound) as they
    come, the bound to `one_step` too.
    The 70B: 0.1946 s proven at the log-softmax's backward in a second; with the step in the
    last block's backward where its plan peaks, a plan at 0.1957 s that fits as read."""
    nf, fixed = problem.num_forward, fixed_bytes(problem)
    part = deadline.within(TIGHTEST_ALONE_SHARE * deadline.left())
    relaxation = Relaxation(problem, [tightest], deadline=part)
    value, exact = relaxation.least_cost({tightest: budget - fixed[tightest - nf]},
                                         lambda op: op.cost, part.left(), workers, gap=GAP)
    proven = found[1] = Bound(value, (tightest,), exact)
    one_step[:] = [proven]
    if value == math.inf:
        return None, proven
    alone = read_plan(problem, budget, relaxation, deadline)
    binding = binding_step(problem, alone) if alone is not None and alone.peak > budget else None
    logger.debug("step %d alone: bound %.6g, plan %s; binds at %s", tightest, value,
                 alone and alone.cost, binding)
    if alone is not None and alone.peak <= budget:
        found[0] = alone
        return alone, proven
    if binding is None or binding == tightest or not deadline.check("reading a plan off the "
                                                                     "relaxation"):
        best = found[0] = alone and repair(problem, alone, budget, deadline)
        return best, proven
    # The joint solve before this plan's repair, which took 3 s of the 70B's 20 under load and
    # is needed only where the joint plan does not fit as read (or the solve is cut).
    steps = sorted([tightest, binding])
    part = deadline.within(TIGHTEST_SHARE * deadline.left())
    try:
        relaxation = Relaxation(problem, steps, rich is not None, deadline=part)
        value, exact = relaxation.least_cost({b: budget - fixed[b - nf] for b in steps},
                                             lambda op: op.cost, part.left(), workers,
                                             gap=PLAN_GAP)
    except OutOfTime:  # its part spent in the build: the plan alone, repaired, with the rest
        value, exact, relaxation = 0.0, False, None
    if rich is not None and value > 0 and (not rich or value > rich[0].value):
        rich[:] = [Bound(value, tuple(steps), exact)]
    read = relaxation and read_plan(problem, budget, relaxation, deadline)
    best = found[0] = read if read is not None and read.peak <= budget else None
    if best is not None and best.cost <= value * (1 + PLAN_GAP):
        logger.debug("steps %s: bound %.6g, plan %s", steps, value, read.cost)
        return best, proven
    # Cut short: the joint plan (nearer the budget) and the lone one repaired, the cheapest kept.
    for plan in (read, alone):
        if plan is None or deadline.left() <= 0:
            continue
        repaired = plan if plan.peak <= budget else repair(problem, plan, budget, deadline)
        if repaired is not None and (best is None or repaired.cost < best.cost):
            best = found[0] = repaired
    logger.debug("steps %s: bound %.6g, plan %s, repaired %s", steps, value, read and read.cost,
                 best and best.cost)
    return best, proven


def read_plan(problem: Problem, budget: int, relaxation: Relaxation,
          deadline: Deadline) -> Schedule | None:
    """The plan of `relaxation`'s solution as read, fitting `budget` or not (None: no solution,
    or a decision the execution model cannot run)."""
    recomputed = relaxation.recomputed()
    if recomputed is None:
        return None
    deadline.charge(modelled("evaluation", len(problem)))
    try:
        return make_schedule(problem, drop_unneeded(problem, recomputed),
                             strategy="relaxation", budget=budget)
    except ValueError:  # e.g. a tuple's getitem
        return None


def _tightest_step(problem: Problem) -> int:
    """The backward step where saving everything peaks (else the first backward step): where
    the forward values still needed and what every schedule holds weigh most, one step's
    knapsack is tightest. The 70B: the log-softmax's backward, four steps in, holding 4.2 GB
    more than the first (its bound 0.1946 s in a second, the first step's 0.1532). The turns
    start from the first step all the same: the joint steps grown from this one
    missed the ones that bind (mamba at 60 %: 7.03e-05, 6.22e-05 from the first step's);
    only its own plan, repaired, is a candidate (the 70B: 0.1986 s, the first step's 0.2060)."""
    step = simulate(problem, make_schedule(problem, ())).peak_step
    if step is None or step.op < problem.num_forward:
        return problem.num_forward
    return step.op


def binding_step(problem: Problem, schedule: Schedule) -> int | None:
    """The backward op at whose step `schedule` peaks (a recomputation's: the op it precedes),
    where the budget binds; None when it peaks in the forward."""
    step = simulate(problem, schedule).peak_step
    if step is None or step.op < problem.num_forward and step.op not in schedule.recompute_at:
        return None
    return schedule.recompute_at.get(step.op, step.op)


def loaded_bound(problem: Problem, budget: int, plan: Schedule, deadline: Deadline,
                 enough: Callable[[float], bool]) -> Bound:
    """The best bound over the rich space that joint relaxations over the steps where `plan`
    holds the most (`loaded_steps`) prove within `deadline`, more steps a solve, until one is
    `enough`. Over those steps the relaxation counts the runs a value needs where it is held
    at some and not between (`Relaxation._count_runs`): what makes a rich plan's second runs
    cost what they do."""
    order = loaded_steps(problem, plan)
    best = Bound(0.0, (), False)
    count = LOADED_FIRST
    while count <= LOADED_MOST and deadline.check("proving a bound where the plan holds the "
                                                  "most"):
        steps = sorted(order[:count])
        if len(steps) < 2:
            break
        found = joint_bound(problem, budget, steps, rich=True, deadline=deadline)
        if found.value > best.value:
            best = found
        if found.value == math.inf or enough(best.value) or len(steps) < count:
            break
        count += LOADED_MORE
    return best


def loaded_steps(problem: Problem, schedule: Schedule) -> list[int]:
    """The backward ops, the one at whose step `schedule` holds the most first: where the
    budget binds it, and where a joint relaxation (`joint_bound`) learns why it costs what it
    does (mamba at 60 %: its rich plan's twenty most loaded steps prove 5.827e-05 against its
    5.831e-05; the steps spread over the backward, 4.79e-05)."""
    live: dict[int, int] = {}
    for step in simulate(problem, schedule).steps:
        if step.op >= problem.num_forward:
            live[step.op] = max(live.get(step.op, 0), step.live)
    return sorted(live, key=lambda b: -live[b])
