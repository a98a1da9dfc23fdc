"""The FLOPs objective: exact against brute force, and never more FLOPs than the time objective."""
import random
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, assume, given, settings, strategies as st

from remat.errors import BudgetError
from remat.solvers import Problem, SolverOptions, Status, Strategy, make_schedule, simulate, solve
from remat.solvers.core.objective import Objective, with_objective
from tests.synthetic.problems import random_problem, transformer

FLOPS = SolverOptions(cost_resolution=1e-9, workers=2, time_limit=30, objective="flops",
                      model="single")  # brute_force, the oracle, searches the single space


def with_random_flops(problem: Problem, seed: int) -> Problem:
    """Seconds and FLOPs that disagree: a third of the ops cost time but no FLOPs (pointwise),
    the others get FLOPs unrelated to their seconds."""
    rng = random.Random(seed)
    ops = tuple(replace(op, flops=0 if rng.random() < 0.33 else rng.randint(1, 50) * 1000)
                for op in problem.ops)
    return Problem(ops, name=problem.name)


small = st.builds(lambda seed, f, b: with_random_flops(
    random_problem(seed, max_forward=f, max_backward=b), seed),
    st.integers(0, 2 ** 32 - 1), st.integers(1, 10), st.integers(0, 6))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problem=small, where=st.floats(0.0, 1.0))
def test_flops_objective_matches_brute_force(problem, where):
    try:
        oracle_low = solve(problem, 0, Strategy.BRUTE_FORCE, FLOPS)
        low = oracle_low.peak
    except BudgetError as e:
        low = e.smallest
    except ValueError:  # too many schedules to enumerate
        assume(False)
    high = simulate(problem, make_schedule(problem, [])).peak
    budget = low + int(where * (high - low))
    oracle = solve(problem, budget, Strategy.BRUTE_FORCE, FLOPS)
    exact = solve(problem, budget, Strategy.OPTIMAL, FLOPS)
    assert exact.status is Status.OPTIMAL
    assert exact.info["objective"] == "flops"
    tolerance = len(problem.candidates) * 1e-9 * with_objective(problem, "flops").total_cost + 1e-6
    assert exact.info["objective_cost"] == pytest.approx(oracle.info["objective_cost"],
                                                         abs=tolerance)
    assert exact.recompute_flops == oracle.recompute_flops
    # Evaluated back in the problem's own units: seconds and FLOPs of what it recomputes.
    assert exact.cost == pytest.approx(sum(problem.ops[v].cost for v in exact.recomputed))
    assert exact.peak <= budget


def test_flops_objective_trades_seconds_for_flops():
    problem = transformer(layers=2, batch=2, seq=64, d_model=64, heads=4)
    save_all = simulate(problem, make_schedule(problem, [])).peak
    budget = int(save_all * 0.6)
    options = SolverOptions(workers=2, time_limit=20, relative_gap=0.0)
    by_time = solve(problem, budget, Strategy.OPTIMAL, options)
    by_flops = solve(problem, budget, Strategy.OPTIMAL, replace(options, objective="flops"))
    assert by_flops.peak <= budget and by_time.peak <= budget
    assert by_time.status is Status.OPTIMAL and by_flops.status is Status.OPTIMAL
    assert by_flops.recompute_flops <= by_time.recompute_flops
    assert by_time.cost <= by_flops.cost * (1 + 1e-6)
    assert by_time.info.get("objective") is None  # the default solves the problem as given


def test_time_objective_is_the_problem_itself():
    problem = transformer(layers=1)
    assert with_objective(problem, "time") is problem
    flops = with_objective(problem, Objective.FLOPS)
    assert [op.flops for op in flops.ops] == [op.flops for op in problem.ops]
    # A zero-FLOP op keeps a small positive cost, so it is never recomputed for nothing.
    zero = [i for i, op in enumerate(problem.ops) if op.flops == 0 and op.cost > 0]
    assert zero and all(0 < flops.ops[i].cost < min(op.flops for op in problem.ops if op.flops)
                        for i in zero)


def test_unknown_objective_names_the_choices():
    with pytest.raises(ValueError, match="time, flops"):
        with_objective(transformer(layers=1), "memory")
