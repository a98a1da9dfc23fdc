"""The least-peak search: the schedule of least simulated peak whatever its cost, which starts
the search near the floor (where no baseline fits) and is the smallest budget BudgetError names.
And that error's message, which says exactly what is proven and what was only found.
"""
from __future__ import annotations

import math

from ortools.sat.python import cp_model

from remat.errors import BudgetError
from remat.solvers.relaxation.bound import peak_bound
from remat.solvers.relaxation.descent import descend
from remat.solvers.cpsat.hints import Pool
from remat.solvers.cpsat.search import cp_solver, run_solver
from remat.solvers.core.deadline import Deadline
from remat.solvers.cpsat.units import Units
from remat.solvers.core.options import SolverOptions
from remat.solvers.core.problem import Problem
from remat.solvers.core.strategy import Strategy
from remat.solvers.core.schedule import Schedule
from remat.solvers.timeline.evaluate import evaluate, make_schedule

# The share of the time limit the floor's proof (bound.peak_bound) may take for the message.
FLOOR_SHARE = 0.1
# The share of the search's time the descent (`remat.solvers.relaxation.descent`) may take
# before CP-SAT, hinted with its plan, searches on.
DESCENT_SHARE = 0.7


class _Enough(cp_model.CpSolverSolutionCallback):
    """Stops the search at the first schedule whose peak (in the model's units) is `target`
    or less: a budget is met, and the least-cost stage takes over from there."""

    def __init__(self, target: float):
        super().__init__()
        self.target = target

    def on_solution_callback(self) -> None:
        if self.ObjectiveValue() <= self.target:
            self.StopSearch()


def least_peak(problem: Problem, units: Units, options: SolverOptions, pool: Pool, model,
               deadline: Deadline, target: int = -1, start: Schedule | None = None
               ) -> tuple[Schedule | None, bool]:
    """The schedule of least simulated peak found before `deadline` (whatever its cost), and
    whether that peak is proven the least, by `model` (a FreeModel or JitModel with no capacity
    yet). Started from the pool's schedule of least peak, the search can only improve on it;
    None when the time allowed nothing at all. `start` (a plan of low peak from elsewhere)
    competes with the plan the descent reached from the pool's
    (`remat.solvers.relaxation.descent`) to start CP-SAT. It stops early at a peak of `target`
    units (a capacity): then the peak is not the least, but the budget is met."""
    baseline = pool.least_peak(deadline)
    if baseline is not None:
        # CP-SAT alone rarely lowers a max over every step: descend first, always from the
        # pool's plan (whatever the budget asked, the same plans in the same order, so a budget
        # named by one call is met by the next where the time allows as much).
        baseline = descend(problem, baseline, deadline.within(DESCENT_SHARE * deadline.left()),
                           target=target * units.byte if target >= 0 else -1)
    baseline = min((s for s in (baseline, start) if s is not None),
                   key=lambda s: (s.peak, s.cost), default=None)
    if not deadline.check("searching for the least peak"):
        return baseline, False
    model.model.Minimize(model.peak)
    if baseline is not None:
        model.hint(baseline)
    solver = cp_solver(options, deadline)
    status = run_solver(solver, model.model, deadline, "searching for the least peak",
                        _Enough(target))
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return baseline, False
    recomputed, positions = model.decision(solver.Value)
    found = make_schedule(problem, recomputed, recompute_at=positions,
                          strategy=Strategy.OPTIMAL.value)
    if baseline is not None and baseline.peak < found.peak:
        return baseline, False
    # Proven in the model's units, which are the bytes themselves only when exact.
    return found, status == cp_model.OPTIMAL and model.exact


def too_small(problem: Problem, budget: int, smallest: Schedule, proven: bool,
              options: SolverOptions, deadline: Deadline, rich: bool = False) -> BudgetError:
    """BudgetError for `budget`, naming `smallest.peak` (a budget that fits: the schedule is
    there) and, where that peak is not proven least, the floor that is proven. `rich`: the
    call searches the rich space ("auto", "rich"), where the single model's proof (`proven`)
    does not hold (a value run twice, or again within the forward, may peak lower) and the
    floor is the rich relaxation's (`peak_bound(rich=True)`: the single one's joint steps
    claimed up to 345 bytes on random steps whose rich space reaches 286)."""
    proven = proven and not rich
    remedy = ("Raise the budget or shrink what the backward must hold (smaller batch, "
              "sequence)")
    if not proven:
        floor = math.floor(peak_bound(problem, time_limit=FLOOR_SHARE * deadline.limit,
                                      deadline=deadline, rich=rich).value)
        proven = floor >= smallest.peak
    found = f"the least peak found is {smallest.peak:,} bytes, a budget that fits"
    unproven = f"{found} (not proven the least: a longer time_limit may find a smaller one)"
    if proven:
        words = (f"the smallest activation peak any schedule reaches is {smallest.peak:,} bytes "
                 f"(proven); recomputation cannot go lower. {remedy}")
    elif floor > budget:  # the cause is proven, the figure only found
        words = f"no schedule peaks below {floor:,} bytes (proven); {unproven}. {remedy}"
    elif budget <= 0:  # the least peak asked for; nothing proven below it
        words = f"every schedule holds some activations; {unproven}. {remedy}"
    else:  # the time ran out, not (provably) the memory
        below = (f"no schedule peaks below {floor:,} bytes (proven), so a budget between the two"
                 if floor > 0 else "no floor was proven in the time, so a budget below that")
        words = (f"none was found within the time limit: {found} (not proven the least); "
                 f"{below} may fit with a longer time_limit")
    return BudgetError(f"no schedule fits a budget of {budget:,} bytes: {words}",
                       budget=budget, smallest=smallest.peak, proven=proven,
                       schedule=evaluate(problem, smallest, strategy=Strategy.OPTIMAL.value))
