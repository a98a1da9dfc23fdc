"""The plan read off the bound's relaxation: it fits, and its bound is a bound."""
import math

from hypothesis import HealthCheck, assume, given, settings, strategies as st

from remat.errors import BudgetError
from remat.solvers import SolverOptions, Strategy, make_schedule, simulate, solve
from remat.solvers.relaxed import relaxed_schedule
from remat.solvers.synthetic import random_problem, transformer

ORACLE = SolverOptions(cost_resolution=1e-9, workers=2, time_limit=30)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2 ** 32 - 1), where=st.floats(0.0, 1.0))
def test_relaxed_plan_fits_and_its_bound_holds(seed, where):
    problem = random_problem(seed, max_forward=10, max_backward=6)
    try:
        least = solve(problem, 0, Strategy.BRUTE_FORCE, ORACLE)
    except ValueError:
        assume(False)
    except BudgetError as error:
        least = error
    low = least.smallest if isinstance(least, BudgetError) else least.peak
    high = simulate(problem, make_schedule(problem, [])).peak
    budget = low + int(where * (high - low))
    best = solve(problem, budget, Strategy.BRUTE_FORCE, ORACLE)
    plan, bound = relaxed_schedule(problem, budget, time_limit=5, workers=2)
    assert bound.value != math.inf
    assert bound.value <= best.cost * (1 + 1e-12)
    if plan is not None:
        assert plan.peak == simulate(problem, plan).peak <= budget
        assert plan.cost >= best.cost * (1 - 1e-12)


def test_relaxed_plan_on_a_stack_is_near_its_bound():
    """On a stack of blocks the first step's relaxation, grown to where its plan binds and
    repaired, gives a plan within a few percent of the bound it proves."""
    problem = transformer(layers=6, batch=2, seq=256, d_model=256, heads=4)
    budget = simulate(problem, make_schedule(problem, [])).peak // 2
    plan, bound = relaxed_schedule(problem, budget, time_limit=10)
    assert plan is not None and plan.peak <= budget
    assert 0 < bound.value <= plan.cost <= 1.05 * bound.value, (plan.cost, bound)
