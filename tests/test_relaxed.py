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


def test_optimal_stops_once_the_relaxed_plan_is_proven_within_relative_gap():
    """With relative_gap, `optimal` returns the relaxation's plan as soon as its proven bound
    is that close, without building the CP-SAT model; the gap it states is a true gap (its
    bound is at most the cost proven optimal by the full search at relative_gap 0)."""
    problem = transformer(layers=6, batch=2, seq=256, d_model=256, heads=4)
    budget = simulate(problem, make_schedule(problem, [])).peak // 2
    quick = solve(problem, budget, Strategy.OPTIMAL,
                  SolverOptions(workers=2, time_limit=20, relative_gap=0.05))
    assert "stopped" in quick.info and "variables" not in quick.info  # no model was built
    assert quick.peak == simulate(problem, quick).peak <= budget
    assert 0 <= quick.gap <= 0.05
    full = solve(problem, budget, Strategy.OPTIMAL, SolverOptions(workers=2, time_limit=20))
    assert "stopped" not in full.info  # at relative_gap 0 the search always runs
    assert quick.bound <= full.cost * (1 + 1e-9)
    assert quick.cost >= full.bound * (1 - 1e-9)
