"""A plan over the rich space read off the single space's relaxation (`Relaxation`), for the
calls that search the rich space ("auto", "rich"): each plan read is given second backward runs
where it peaks (`repair_again.settle`), and the step where the settled plan binds joins the
relaxation, until a settled plan fits, the steps repeat, or the deadline; where none fits, the
plans read are repaired (`repair`'s cover and trim, each plan settled).

Why not the single call's plans (`relaxed`): a plan that fits only with a second run peaks, as
the single space sees it, where the recomputed value is held to its far reader; so that call
joins that step and its relaxation recomputes something else, or covers the excess by
recomputing more (mamba at 60 % of its save-all peak: 6.24e-05 covered, 6.22e-05 the single
optimum). Here the step joined is where the plan binds once second runs are allowed: mamba's
three steps of the single call (260, 319, 353) bind at 320, and with it the relaxation's plan
(5.42e-05) fits with `mul_22` run again before op 361, at 5.83e-05, in a few tenths of a
second.
"""
from __future__ import annotations

import logging
import math
from typing import Iterable

from remat.solvers.relaxation.bound import fixed_bytes
from remat.solvers.core.deadline import Deadline, OutOfTime
from remat.solvers.core.problem import Problem
from remat.solvers.relaxation.relaxation import Relaxation
from remat.solvers.relaxation.relaxed import GAP, binding_step, read_plan
from remat.solvers.relaxation.repair import repair
from remat.solvers.relaxation.second_runs import settle
from remat.solvers.core.schedule import Schedule

__all__ = ["rich_relaxed_plan"]

logger = logging.getLogger(__name__)

# At most this many steps joined: each solve grows with them (mamba's three: 0.07 s; 2,000
# ops at six steps, a second).
MAX_STEPS = 8


def rich_relaxed_plan(problem: Problem, budget: int, steps: Iterable[int], deadline: Deadline,
                      workers: int = 0) -> Schedule | None:
    """The cheapest plan of the rich space found this way that fits `budget` (None: none in
    time), starting from the relaxation over `steps` (none: the first backward step)."""
    nf = problem.num_forward
    steps = sorted({b for b in steps if nf <= b < len(problem.ops)}
                   or ({nf} if nf < len(problem.ops) else set()))
    if not steps:
        return None
    best: Schedule | None = None
    fixed = fixed_bytes(problem)
    read: list[Schedule] = []  # the plans read that did not fit with second runs alone

    def settled(schedule: Schedule) -> Schedule:
        return settle(problem, schedule, budget, deadline)

    try:
        while len(steps) <= MAX_STEPS and deadline.check("reading a rich plan off the "
                                                         "relaxation"):
            relaxation = Relaxation(problem, steps, deadline=deadline)
            rooms = {b: budget - fixed[b - nf] for b in steps}
            if min(rooms.values()) < 0:
                break
            value, _ = relaxation.least_cost(rooms, lambda op: op.cost, deadline.left(),
                                             workers, gap=GAP)
            plan = None if value == math.inf else read_plan(problem, budget, relaxation,
                                                            deadline)
            if plan is None:
                break
            again = settled(plan)
            logger.debug("rich plan over %s: bound %.6g, plan %.6g peaking %d over, with "
                         "second runs %.6g peaking %d over", steps, value, plan.cost,
                         plan.peak - budget, again.cost, again.peak - budget)
            if again.peak <= budget:
                best = again  # the relaxation's own plan, with second runs: more steps cost more
                break
            read.append(plan)
            binding = binding_step(problem, again)
            if binding is None or binding in steps:
                break
            steps = sorted(steps + [binding])
        # None fitted with second runs alone: covered (recomputing more), the last read first,
        # which knows the most steps.
        for plan in reversed(read if best is None else ()):
            fitted = repair(problem, plan, budget, deadline, settled)
            logger.debug("rich plan repaired: %s", fitted and fitted.cost)
            if fitted is not None and (best is None or fitted.cost < best.cost):
                best = fitted
    except OutOfTime:
        pass
    return best
