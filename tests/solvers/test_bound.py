"""The bounds proven from single backward steps, against the oracle and the simulator."""
import math
import random

import pytest
from hypothesis import HealthCheck, assume, given, settings, strategies as st

from remat.errors import BudgetError
from remat.solvers import SolverOptions, Strategy, make_schedule, simulate, solve
from remat.solvers.relaxation.bound import fixed_bytes, peak_bound, recompute_bound
from remat.solvers.core.objective import with_objective
from tests.oracles.brute_least import brute_least_peak
from tests.synthetic.problems import (chain, diamond, random_problem, transformer, unet,
                                      with_free_values)

# Free positions: the oracle enumerates every placement, the widest set of schedules a bound
# must stay under.
ORACLE = SolverOptions(cost_resolution=1e-9, workers=2, time_limit=30)

small = st.builds(lambda seed, f, b: random_problem(seed, max_forward=f, max_backward=b),
                  st.integers(0, 2 ** 32 - 1), st.integers(1, 10), st.integers(1, 6))


def oracle(problem, budget):
    try:
        return solve(problem, budget, Strategy.BRUTE_FORCE, ORACLE)
    except BudgetError as error:
        return error


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problem=small, where=st.floats(-0.2, 1.0), flops=st.booleans())
def test_no_schedule_beats_the_bounds(problem, where, flops):
    problem = with_objective(problem, "flops") if flops else problem
    floor = brute_least_peak(problem)
    assume(floor is not None)  # None: too many schedules to enumerate
    assert peak_bound(problem).value <= floor

    top = simulate(problem, make_schedule(problem, [])).peak
    budget = max(0, floor + int(where * (top - floor)))
    best = oracle(problem, budget)
    bound = recompute_bound(problem, budget)
    if isinstance(best, BudgetError):
        return  # any bound holds vacuously; math.inf is the claim that nothing fits
    assert bound.value != math.inf, "claimed that nothing fits a budget a schedule meets"
    # Integer costs are rounded down, so the bound may only be low, never high.
    assert bound.value <= best.cost * (1 + 1e-12) + 1e-15


@pytest.mark.parametrize("problem", [diamond(), unet(), transformer(layers=2)],
                         ids=lambda p: p.name)
def test_fixed_bytes_are_what_save_all_holds_beside_forward_values(problem):
    """Independently of `holds`: under save-all, a backward step holds its fixed bytes plus every
    forward storage (not an output) whose last backward reader has not run yet."""
    nf = problem.num_forward
    save_all = make_schedule(problem, [])
    timeline = simulate(problem, save_all)
    fixed = fixed_bytes(problem)
    for step in timeline.steps[nf:]:
        b = step.op
        held = sum(problem.ops[v].size for v in save_all.saved
                   if v not in problem.pinned
                   and max(problem.storage_readers[v]) >= b)
        assert step.live == fixed[b - nf] + held


def test_a_budget_below_what_a_step_must_hold_is_proven_infeasible():
    problem = unet()
    need = peak_bound(problem)
    assert need.exact and len(need.steps) == 1
    assert recompute_bound(problem, int(need.value) - 1, steps=need.steps).value == math.inf
    with pytest.raises(BudgetError):
        solve(problem, int(need.value) - 1, Strategy.OPTIMAL, ORACLE)


def test_the_bound_is_the_optimum_where_one_step_decides():
    """The diamond's backward needs b and c at once: keeping one and recomputing the other is
    all any schedule can do, so the bound meets the optimum where recomputing is needed."""
    problem = diamond()
    floor = brute_least_peak(problem)
    for budget in (floor, floor + (1 << 19)):
        best = oracle(problem, budget)
        assert best.cost > 0
        assert recompute_bound(problem, budget).value == pytest.approx(best.cost, rel=1e-6)


def test_optimal_reports_at_least_the_step_bound():
    problem = transformer(layers=2)
    top = simulate(problem, make_schedule(problem, [])).peak
    schedule = solve(problem, int(0.8 * top), Strategy.OPTIMAL,
                     SolverOptions(time_limit=10, workers=2))
    step = schedule.info["step_bound"]
    assert 0 < step <= schedule.cost
    assert schedule.bound >= step * (1 - 1e-9)
    assert schedule.info["step_bound_at"]


def test_steps_together_meet_the_optimum_on_a_chain():
    """Alone, each step misses the recomputation made just before it (one layer's); the joint
    model ties the steps by one decision per value and closes that gap on an MLP chain."""
    problem = chain(layers=8)
    top = simulate(problem, make_schedule(problem, [])).peak
    with pytest.raises(BudgetError) as least:
        solve(problem, 0, Strategy.OPTIMAL, ORACLE)
    floor = least.value.smallest
    for share in (0.0, 0.5, 0.75):
        budget = floor + int(share * (top - floor))
        best = solve(problem, budget, Strategy.OPTIMAL, ORACLE)
        assert best.status.value == "OPTIMAL" and best.cost > 0
        bound = recompute_bound(problem, budget)
        assert len(bound.steps) > 1
        assert bound.value == pytest.approx(best.cost, rel=1e-6)


fused = st.builds(lambda seed, f, b: with_free_values(
    random_problem(seed, max_forward=f, max_backward=b), random.Random(seed)),
    st.integers(0, 2 ** 32 - 1), st.integers(2, 10), st.integers(1, 6))


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problem=fused, where=st.floats(-0.2, 1.0))
def test_no_schedule_beats_the_bounds_where_recomputations_fuse(problem, where):
    """With values a compiled step fuses into their readers: the simulator holds such a value's
    recomputed copy at no bytes where it serves one op, so the relaxations must not count it
    either (they did, and proved a Qwen2's compiled problem needed 3.22e9 recompute FLOPs at
    a budget where a plan of 3.09e9 fits)."""
    assume(problem.fused_recomputations)
    test_no_schedule_beats_the_bounds.hypothesis.inner_test(problem, where, False)
