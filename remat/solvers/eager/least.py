"""The eager policy of least peak whatever its cost (`least_eager_peak`), and the BudgetError
that names it as the smallest budget, proven or found (`too_small`)."""
from __future__ import annotations

import math
from typing import Iterable

from ortools.sat.python import cp_model

from remat.errors import BudgetError
from remat.solvers.core.deadline import Deadline, OutOfTime
from remat.solvers.core.options import SolverOptions
from remat.solvers.core.problem import Problem
from remat.solvers.core.schedule import Schedule
from remat.solvers.eager.cp_run import eager_units, solve_model
from remat.solvers.eager.model import EagerModel
from remat.solvers.timeline.eager import eager_schedule
from remat.solvers.timeline.eager_blocks import EagerBlocks


def least_eager_peak(problem: Problem, blocks: EagerBlocks, options: SolverOptions, *,
                     deadline: Deadline | None = None, start: Iterable[int] = ()
                     ) -> tuple[Schedule, int]:
    """The policy of least eager peak found in the time (whatever its cost), and the peak
    proven to be the least (bytes; equal to the policy's when proven). `start`: a policy to
    start from (by default, caching nothing)."""
    options = options.by_size(len(problem))
    deadline = deadline or Deadline(options.time_limit)
    deadline.enter("eager: least peak")
    units = eager_units(problem, blocks, options)
    first = eager_schedule(problem, blocks, start)
    if not deadline.check("eager: least peak"):
        return first, 0
    try:
        model = EagerModel(problem, blocks, units, deadline)
    except OutOfTime:
        return first, 0
    model.model.Minimize(model.peak)
    model.hint(first.info["cached"])
    status, solver = solve_model(model, options, deadline, deadline.left(), "least peak")
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return first, model.fixed_peak * units.byte if units.exact_rounding else 0
    found = eager_schedule(problem, blocks, model.decision(solver.Value))
    floor = math.ceil(solver.BestObjectiveBound()) * units.byte if units.exact_rounding else 0
    best = min((first, found), key=lambda s: s.peak)
    return best, min(floor, best.peak)


def too_small(budget: int, least: Schedule, floor: int, how: str) -> BudgetError:
    """BudgetError for `budget`, naming `least.peak` as the smallest budget: proven where
    `floor` (the peak proven least) reaches it, else found (by `how`), the floor named where
    one was proven."""
    proven = floor >= least.peak
    if proven:
        words = f"the least eager peak of any per-block policy is {least.peak:,} bytes (proven)"
    else:
        words = (f"the least eager peak found is {least.peak:,} bytes, a budget that fits "
                 f"(found by {how} within the time limit, not proven the least: a longer "
                 "time_limit may find a smaller one)"
                 + (f"; no policy peaks below {floor:,} bytes (proven)" if floor > 0 else ""))
    lead = ("every policy holds some activations" if budget <= 0 else
            f"no checkpoint policy fits a budget of {budget:,} bytes of activations")
    return BudgetError(
        f"eager: {lead}; {words}; checkpoint more modules (blocks=) or raise the budget",
        budget=budget, smallest=least.peak, schedule=least, proven=proven)
