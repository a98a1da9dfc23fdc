"""The exact solver against the oracle, the simulator and the baselines.

Random problems use whole-second costs and `cost_resolution=1e-9`, so that CP-SAT's integer
costs are exact (a unit of 1e-9 of the least cost is far below the 1 s between distinct sums).
OPTIMAL promises a true cost within 0.01 % of a proven bound, so costs compare within that.
"""
import random
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, assume, example, given, settings, strategies as st

from remat.errors import BudgetError
from remat.solvers import Op, Phase, Problem, SolverOptions, Status, Strategy, make_schedule, simulate, solve
from remat.solvers.baselines.brute_force import MAX_SCHEDULES
from remat.solvers.core.schedule import OPTIMAL_TOLERANCE
from tests.synthetic.problems import chain, diamond, random_problem, transformer, unet

# The single model: the oracle (Strategy.BRUTE_FORCE) enumerates its space.
EXACT = SolverOptions(cost_resolution=1e-9, workers=2, time_limit=30, model="single")
BASELINES = (Strategy.SAVE_ALL, Strategy.CHECKPOINT_BLOCKS, Strategy.CHEN_SQRT, Strategy.GREEDY,
             Strategy.SELECTIVE)


def tolerance(problem: Problem, options: SolverOptions = EXACT) -> float:
    """What OPTIMAL promises: the true cost within OPTIMAL_TOLERANCE of a proven bound, which is
    at most the optimum; in seconds, at most that share of every recompute cost together."""
    return OPTIMAL_TOLERANCE * problem.total_cost + 1e-12


def model_peak_is_simulated(schedule) -> None:
    """The model's profile is simulate's, where the least-peak stage made its ends tight (it is
    skipped when nothing is recomputed: the peak is then fixed)."""
    if schedule.recomputed:
        assert schedule.info["model_peak"] == schedule.peak
    else:
        assert schedule.info["peak_stage"] == "skipped: nothing is recomputed"


def save_all_peak(problem: Problem) -> int:
    return simulate(problem, make_schedule(problem, [])).peak


def outcome(problem, budget, strategy, options=EXACT):
    try:
        return solve(problem, budget, strategy, options)
    except BudgetError as error:
        return error


def smallest_peak(problem, options=EXACT) -> int:
    result = outcome(problem, 0, Strategy.BRUTE_FORCE, options)
    return 0 if not isinstance(result, BudgetError) else result.smallest


small = st.builds(lambda seed, f, b: random_problem(seed, max_forward=f, max_backward=b),
                  st.integers(0, 2 ** 32 - 1), st.integers(1, 12), st.integers(0, 7))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problem=small, where=st.floats(-0.1, 1.0))
def test_optimal_matches_brute_force(problem, where):
    try:
        low = smallest_peak(problem)
    except ValueError:  # too many schedules to enumerate
        assume(False)
    high = save_all_peak(problem)
    budget = max(0, low + int(where * (high - low)) if where >= 0 else low - 1)
    oracle = outcome(problem, budget, Strategy.BRUTE_FORCE)
    exact = outcome(problem, budget, Strategy.OPTIMAL)
    if isinstance(oracle, BudgetError):
        assert isinstance(exact, BudgetError)
        assert exact.smallest == oracle.smallest == low
        assert str(low) in str(exact).replace(",", "")
        return
    assert not isinstance(exact, BudgetError), (budget, oracle.cost)
    assert exact.status is Status.OPTIMAL
    assert exact.cost == pytest.approx(oracle.cost, abs=tolerance(problem))
    assert exact.bound <= oracle.cost * (1 + 1e-12)  # a bound, never above the optimum
    assert exact.peak == oracle.peak  # least peak among the cheapest
    model_peak_is_simulated(exact)


JUST_IN_TIME = SolverOptions(cost_resolution=1e-9, workers=2, time_limit=30, free_positions=False)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problem=small, where=st.floats(-0.1, 1.0))
# A value read only by recomputations was both saved and recomputed in the model, which then
# placed its recomputation later than the just-in-time rule does (planned 247, simulated 263).
@example(problem=random_problem(0, max_forward=7, max_backward=3), where=0.0)
# Cost units of 1e-9 of the least cost made CP-SAT call the least-peak stage INFEASIBLE (model
# peak 426, simulated 410), and the relaxation's bisection never ended (16 s on 16 ops).
@example(problem=random_problem(30, max_forward=9, max_backward=6), where=0.5)
def test_just_in_time_matches_brute_force(problem, where):
    """The just-in-time model (free_positions=False) against the oracle enumerating the same
    space: every recomputed set, each placed by make_schedule's default rule."""
    try:
        low = smallest_peak(problem, JUST_IN_TIME)
    except ValueError:
        assume(False)
    high = save_all_peak(problem)
    budget = max(0, low + int(where * (high - low)) if where >= 0 else low - 1)
    oracle = outcome(problem, budget, Strategy.BRUTE_FORCE, JUST_IN_TIME)
    exact = outcome(problem, budget, Strategy.OPTIMAL, JUST_IN_TIME)
    if isinstance(oracle, BudgetError):
        assert isinstance(exact, BudgetError)
        assert exact.smallest == oracle.smallest == low
        return
    assert not isinstance(exact, BudgetError), (budget, oracle.cost)
    assert exact.status is Status.OPTIMAL
    assert exact.cost == pytest.approx(oracle.cost, abs=tolerance(problem))
    assert exact.peak == oracle.peak
    model_peak_is_simulated(exact)
    assert dict(exact.recompute_at) == dict(make_schedule(problem, exact.recomputed).recompute_at)


def test_free_positions_never_worse_than_just_in_time():
    for seed in range(15):
        problem = random_problem(seed, max_forward=10, max_backward=6)
        budget = (smallest_peak(problem) + save_all_peak(problem)) // 2
        free = outcome(problem, budget, Strategy.OPTIMAL)
        jit = outcome(problem, budget, Strategy.OPTIMAL, JUST_IN_TIME)
        if isinstance(free, BudgetError):
            assert isinstance(jit, BudgetError)
        elif not isinstance(jit, BudgetError):
            assert free.cost <= jit.cost + tolerance(problem)


problems = st.one_of(
    small,
    st.builds(lambda s: random_problem(s, max_forward=60, max_backward=60),
              st.integers(0, 2 ** 32 - 1)),
    st.sampled_from([chain(4), chain(12), diamond(), unet(2), unet(3), transformer(1),
                     transformer(2, seq=128, d_model=64, heads=2)]),
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problem=problems, where=st.floats(0.0, 1.0))
def test_claimed_peak_is_simulated_and_fits(problem, where):
    budget = int(where * save_all_peak(problem))
    strategies = list(BASELINES) + [Strategy.OPTIMAL]
    for strategy in strategies:
        result = outcome(problem, budget, strategy, SolverOptions(workers=2, time_limit=10))
        if isinstance(result, BudgetError):
            assert result.smallest is None or result.smallest > budget
            continue
        assert result.peak == simulate(problem, result).peak
        assert result.peak <= budget
        assert result.strategy == strategy.value


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problem=problems, where=st.floats(0.2, 1.0))
def test_optimal_never_worse_than_a_baseline(problem, where):
    assert len(problem) <= 200
    budget = int(where * save_all_peak(problem))
    exact = outcome(problem, budget, Strategy.OPTIMAL)
    for strategy in BASELINES:
        base = outcome(problem, budget, strategy)
        if isinstance(base, BudgetError):
            continue
        assert not isinstance(exact, BudgetError), strategy
        if exact.status is Status.OPTIMAL:
            assert exact.cost <= base.cost + tolerance(problem, EXACT)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problem=small, points=st.lists(st.floats(0, 1), min_size=2, max_size=4))
def test_cost_never_increases_with_budget(problem, points):
    high = save_all_peak(problem)
    costs = []
    for where in sorted(points):
        result = outcome(problem, int(where * high), Strategy.OPTIMAL)
        costs.append(None if isinstance(result, BudgetError) else result.cost)
    feasible = [c for c in costs if c is not None]
    assert costs[len(costs) - len(feasible):] == feasible  # once it fits, it keeps fitting
    assert all(a + tolerance(problem) >= b for a, b in zip(feasible, feasible[1:]))
    at_save_all = solve(problem, high, Strategy.OPTIMAL, EXACT)
    assert at_save_all.cost == 0


# --- Degenerate cases, exact.

def test_empty_problem():
    result = solve(Problem(()), 0, Strategy.OPTIMAL, EXACT)
    assert (result.cost, result.peak, result.recomputed, result.saved) == (0, 0, frozenset(), frozenset())
    assert solve(Problem(()), 0, Strategy.BRUTE_FORCE, EXACT).peak == 0


def test_zero_budget():
    with pytest.raises(BudgetError) as error:
        solve(chain(3), 0, Strategy.OPTIMAL, EXACT)
    assert error.value.smallest == smallest_peak(chain(3)) > 0
    assert "cannot go lower" in str(error.value)
    zero = Problem((Op("a", Phase.FORWARD, size=0), Op("loss", Phase.FORWARD, (0,), is_output=True),
                    Op("g", Phase.BACKWARD, (0, 1))))
    assert solve(zero, 0, Strategy.OPTIMAL, EXACT).peak == 0


def test_zero_byte_tensors_are_saved():
    ops = (Op("a", Phase.FORWARD, size=10, cost=1.0), Op("b", Phase.FORWARD, (0,), size=0, cost=0.0),
           Op("c", Phase.FORWARD, (1,), size=10, cost=1.0),
           Op("loss", Phase.FORWARD, (2,), size=1, is_output=True),
           Op("g", Phase.BACKWARD, (3, 1), size=10), Op("h", Phase.BACKWARD, (4, 2), size=10))
    problem = Problem(ops)
    for budget in range(0, 60, 3):
        oracle = outcome(problem, budget, Strategy.BRUTE_FORCE)
        exact = outcome(problem, budget, Strategy.OPTIMAL)
        assert type(oracle) is type(exact)
        if not isinstance(exact, BudgetError):
            assert (exact.cost, exact.peak) == (oracle.cost, oracle.peak)
            assert 1 not in exact.recomputed


def test_no_backward():
    ops = (Op("a", Phase.FORWARD, size=8, cost=1.0), Op("loss", Phase.FORWARD, (0,), size=4, is_output=True))
    result = solve(Problem(ops), 12, Strategy.OPTIMAL, EXACT)
    assert (result.cost, result.peak, result.status) == (0, 12, Status.OPTIMAL)
    with pytest.raises(BudgetError) as error:
        solve(Problem(ops), 11, Strategy.OPTIMAL, EXACT)
    assert error.value.smallest == 12


def test_trace_and_bound():
    seen = []
    problem = transformer(2, seq=128, d_model=64, heads=2)
    budget = save_all_peak(problem) // 2
    options = SolverOptions(workers=2, time_limit=20, on_solution=seen.append)
    result = solve(problem, budget, Strategy.OPTIMAL, options)
    assert result.info["trace"] == seen and seen
    assert result.bound is not None and result.bound <= result.cost + tolerance(problem, options)


def test_brute_force_refuses_big_problems():
    with pytest.raises(ValueError, match="at most 16"):
        solve(chain(20), 10 ** 12, Strategy.BRUTE_FORCE)
    assert MAX_SCHEDULES > 0


def test_random_problem_is_reproducible():
    assert random_problem(7) == random_problem(random.Random(7))


def test_solvers_import_without_torch():
    code = ("import sys; sys.modules['torch'] = None\n"
            "import remat.solvers\n"
            "from tests.synthetic.problems import chain\n"
            "from remat.solvers import solve, SolverOptions\n"
            "p = chain(4)\n"
            "r = solve(p, 10**12, 'optimal', SolverOptions(workers=1, time_limit=10))\n"
            "assert r.status.value == 'OPTIMAL', r\n"
            "assert 'torch' not in [m.split('.')[0] for m in sys.modules if sys.modules[m]]\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=str(__import__("pathlib").Path(__file__).parents[2]))
    assert done.returncode == 0, done.stderr


def test_a_hint_that_does_not_fit_is_never_returned():
    """When the search accepts nothing in time, `optimal` may return its hint, but only one that
    fits: a caller's hint (here, saving everything) can be over the budget. Per-block
    checkpointing fits here: some plan that fits comes back, however little the time."""
    from remat.solvers import make_schedule
    from remat.solvers.cpsat import optimal
    from tests.synthetic.problems import transformer

    problem = transformer(layers=2)
    save_all = make_schedule(problem, [])
    budget = int(save_all.peak * 0.9)  # fits some schedule, not saving everything
    options = SolverOptions(time_limit=0.01, workers=1, hint=save_all)
    # The strategy itself, not solve(), whose own check would hide the defect.
    assert optimal(problem, budget, options).peak <= budget


def test_a_budget_at_the_smallest_peak_is_met():
    """No baseline fits there, and CP-SAT alone rarely finds a first schedule: the least-peak
    schedule, which the BudgetError below the floor carries, is its start."""
    problem = transformer(layers=2, batch=2, seq=64, d_model=64, heads=4)
    options = SolverOptions(workers=2, time_limit=20)
    with pytest.raises(BudgetError) as below:
        solve(problem, 0, Strategy.OPTIMAL, options)
    floor = below.value.smallest
    assert below.value.schedule is not None and below.value.schedule.peak == floor
    for strategy in BASELINES:
        assert isinstance(outcome(problem, floor, strategy, options), BudgetError)
    at_floor = solve(problem, floor, Strategy.OPTIMAL, options)
    assert at_floor.peak <= floor
