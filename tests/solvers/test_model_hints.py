"""A schedule hinted to a CP-SAT model is a complete solution of it: with every hinted variable
fixed, CP-SAT accepts it at once. The relaxation's plans recompute zero-byte views, which no
model has a variable for; the models must hint them saved, not drop the whole hint (mamba at
60 % of its save-all peak: no hint, and no plan better than 6.22e-05 found in 10 s)."""
from ortools.sat.python import cp_model

from remat.solvers import SolverOptions, make_schedule
from remat.solvers.cpsat.free_model import FreeModel
from remat.solvers.cpsat.jit_model import JitModel
from remat.solvers.cpsat.rich_model import RichModel
from remat.solvers.cpsat.units import Units
from remat.solvers.core.problem import Kind, recompute_blocker
from remat.solvers.core.schedule import drop_unneeded
from remat.solvers.timeline.simulate import simulate
from tests.synthetic.problems import random_problem

OPTIONS = SolverOptions(cost_resolution=1e-9, workers=1, time_limit=10)


def zero_byte(problem, v) -> bool:
    return problem.ops[v].kind is Kind.TENSOR and problem.ops[v].size == 0


def schedules_recomputing_views(count: int):
    """(problem, schedule) pairs whose schedule recomputes a zero-byte tensor beside others,
    from random problems rich in them (deterministic seeds)."""
    found = []
    for seed in range(400):
        problem = random_problem(seed, max_forward=10, max_backward=6, p_zero=0.4)
        may = [v for v in problem.candidates if recompute_blocker(problem, v) is None
               and v not in problem.pinned]
        views = [v for v in may if zero_byte(problem, v)]
        if not views:
            continue
        try:
            schedule = make_schedule(problem, drop_unneeded(problem, may))
        except ValueError:
            continue
        if any(zero_byte(problem, v) for v in schedule.recomputed) and any(
                not zero_byte(problem, v) for v in schedule.recomputed):
            found.append((problem, schedule))
        if len(found) == count:
            break
    assert len(found) == count, "the generator no longer makes such schedules"
    return found


def accepted(model, schedule, units) -> cp_model.CpSolver:
    """CP-SAT on `model` with every hinted variable fixed, the capacity at the schedule's
    peak; asserts that the hint covers every variable and that CP-SAT accepts it."""
    m = model.model
    variables = m.Proto().variables
    decided = {i for i, x in enumerate(variables) if x.domain[0] != x.domain[-1]}  # not constants
    assert decided <= set(m.Proto().solution_hint.vars), "the hint is incomplete"
    m.Add(model.peak <= units.bytes_up(schedule.peak))
    solver = cp_model.CpSolver()
    solver.parameters.fix_variables_to_their_hinted_value = True
    solver.parameters.num_workers = 1
    solver.parameters.max_time_in_seconds = 10
    assert solver.Solve(m) in (cp_model.OPTIMAL, cp_model.FEASIBLE)
    return solver


def test_a_plan_that_recomputes_views_is_a_complete_hint_of_the_single_models():
    for problem, schedule in schedules_recomputing_views(12):
        units = Units.of(problem, OPTIONS)
        free = FreeModel(problem, units)
        free.hint(schedule)
        solver = accepted(free, schedule, units)
        recomputed, _ = free.decision(solver.Value)
        # The same plan, but for the views (saved, with what only they needed): no more
        # cost and no more room.
        assert recomputed <= schedule.recomputed
        assert not any(zero_byte(problem, v) for v in recomputed)
        again = make_schedule(problem, recomputed, recompute_at={
            v: int(solver.Value(free.pos[v])) for v in recomputed})
        assert again.cost <= schedule.cost and simulate(problem, again).peak <= schedule.peak

        jit = JitModel(problem, units)
        jit.hint(schedule)
        accepted(jit, schedule, units)


def test_a_plan_that_recomputes_views_is_a_complete_hint_of_the_rich_model():
    for problem, schedule in schedules_recomputing_views(12):
        units = Units.of(problem, OPTIONS)
        rich = RichModel(problem, units, max_copies=1, offload=False)
        assert rich.hint(schedule)
        accepted(rich, schedule, units)
