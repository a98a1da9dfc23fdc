"""The exact solver over the richer execution model (`SolverOptions.model`): against the
exhaustive search over that space (`rich_brute_force`), against the single model, and on a
hand-made long skip connection where recomputing twice, or within the forward, pays."""
import pytest
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from remat.errors import BudgetError, SolverError
from remat.solvers import solve
from remat.solvers.core.schedule import OPTIMAL_TOLERANCE
from remat.solvers.core.options import SolverOptions
from remat.solvers.core.problem import Kind, Op, Phase, Problem
from tests.oracles.rich_brute import rich_brute_force, rich_smallest_peak
from remat.solvers.core.schedule import Status
from remat.solvers.timeline.evaluate import make_schedule, price
from remat.solvers.timeline.simulate import simulate
from tests.synthetic.problems import random_problem

F, B = Phase.FORWARD, Phase.BACKWARD


def options(model: str, **extra) -> SolverOptions:
    return SolverOptions(cost_resolution=1e-9, workers=2, time_limit=20, model=model, **extra)


def long_skip(skip: int, layer: int, grad: int) -> Problem:
    """x (cheap, `skip` bytes) is read by the first layer and again by the forward's last op,
    and by the backward's first and last ops: a long skip connection over three layers."""
    ops = [Op("x", F, (), size=skip, cost=1.0),
           Op("a1", F, (0,), size=layer, cost=10.0),
           Op("a2", F, (1,), size=layer, cost=10.0),
           Op("a3", F, (2,), size=layer, cost=10.0),
           Op("c", F, (3, 0), size=1, cost=1.0, is_output=True),
           Op("g3", B, (4, 3, 0), size=grad, cost=1.0),
           Op("g2", B, (5, 2), size=grad, cost=1.0),
           Op("g1", B, (6, 1), size=grad, cost=1.0),
           Op("g0", B, (7, 0), size=grad, cost=1.0, is_output=True)]
    return Problem(ops, name="long_skip")


def checked(problem: Problem, schedule, budget: int):
    """The schedule's claimed peak is simulate's and fits; its status is true of its bound."""
    assert schedule.peak == simulate(problem, schedule).peak <= budget
    assert schedule.bound is not None and schedule.bound <= schedule.cost * (1 + 1e-9) + 1e-12
    if schedule.status is Status.OPTIMAL:
        assert schedule.cost - schedule.bound <= OPTIMAL_TOLERANCE * schedule.cost + 1e-12
    return schedule


def test_a_second_recomputation_beats_the_single_model():
    """Budget 23: the single model keeps x (10 bytes) from g3 to g0 and must recompute a1
    (cost 10); the rich model recomputes x (cost 1) before g3 and again before g0."""
    problem, budget = long_skip(skip=10, layer=2, grad=5), 23
    single = checked(problem, solve(problem, budget, "optimal", options("single")), budget)
    assert single.cost == 10.0 and single.status is Status.OPTIMAL
    x = problem.index("x")
    for model in ("rich", "auto"):
        rich = checked(problem, solve(problem, budget, "optimal", options(model)), budget)
        assert rich.cost == 2.0 and rich.status is Status.OPTIMAL, model
        assert rich.info["model"] == "rich"
        assert rich.recompute_at[x] >= problem.num_forward
        assert [p for p in rich.again[x] if p >= problem.num_forward], rich.again
    assert rich_brute_force(problem, budget).cost == 2.0


def test_a_forward_recomputation_fits_where_the_single_model_cannot():
    """Budget 27: holding x (20 bytes) through the forward's three layers exceeds it under
    every single-model schedule; recomputing x before c, within the forward, fits."""
    problem, budget = long_skip(skip=20, layer=5, grad=1), 27
    with pytest.raises(BudgetError):
        solve(problem, budget, "optimal", options("single"))
    x, c = problem.index("x"), problem.index("c")
    for model in ("rich", "auto"):  # "auto" tries the rich model where the single one fails
        rich = checked(problem, solve(problem, budget, "optimal", options(model)), budget)
        assert c in rich.again[x]  # recomputed within the forward, before the skip's reader
        assert rich.status is Status.OPTIMAL and rich.info["model"] == "rich"
        assert rich.cost == rich_brute_force(problem, budget).cost
    with pytest.raises(BudgetError):  # below what even the rich space reaches
        solve(problem, rich_smallest_peak(problem) - 1, "optimal", options("auto"))


def test_auto_keeps_the_single_plan_where_the_rich_bound_meets_it():
    problem, budget = long_skip(skip=10, layer=2, grad=5), 40
    auto = checked(problem, solve(problem, budget, "optimal", options("auto")), budget)
    single = solve(problem, budget, "optimal", options("single"))
    assert auto.cost == single.cost
    assert auto.status is Status.OPTIMAL and auto.info["rich_bound"] is not None
    if auto.info["model"] == "single":  # proven by the bound over the rich space alone
        assert auto.cost - auto.info["rich_bound"] <= OPTIMAL_TOLERANCE * auto.cost


def test_the_options_are_checked():
    with pytest.raises(ValueError, match="model"):
        SolverOptions(model="twice")
    with pytest.raises(ValueError, match="max_copies"):
        SolverOptions(max_copies=-1)


def _small(seed: int, bandwidth: float | None) -> Problem:
    problem = random_problem(seed, max_forward=6, max_backward=5)
    return Problem(problem.ops, name=problem.name, host_bandwidth=bandwidth)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2 ** 32 - 1), where=st.floats(0.0, 0.6),
       bandwidth=st.sampled_from([None, 20.0]), copies=st.sampled_from([1, 2]))
# A getitem's tensor that no read holds lived, in the model, only at an empty slot after its
# tuple op; simulate holds it at the next step, there a recomputation (planned 236, ran 262).
@example(seed=2605, where=0.0, bandwidth=None, copies=1)
# A forward output that no op reads was never recomputed (brute force: before the last op).
@example(seed=3672411032, where=0.0, bandwidth=None, copies=1)
# Costs near 2**31 units with a floor on the cost: CP-SAT called 16.1 OPTIMAL, 10.1 fits.
@example(seed=6500, where=0.0, bandwidth=20.0, copies=1)
def test_rich_optimum_matches_brute_force_and_beats_single(seed, where, bandwidth, copies):
    """Over random small steps (tuple ops, views, random ops, zero-byte values among them),
    with and without a host link: the rich model's optimum costs what the exhaustive search
    over the same space finds, never more than the single model's, and simulates to its
    claimed peak within the budget; its bound never exceeds a feasible cost."""
    problem = _small(seed, bandwidth)
    try:
        low = rich_smallest_peak(problem, max_copies=copies)
    except ValueError:  # too many schedules to enumerate
        assume(False)
    high = simulate(problem, make_schedule(problem, [])).peak
    budget = low + int(where * max(0, high - low))
    try:
        oracle = rich_brute_force(problem, budget, max_copies=copies)
    except ValueError:
        assume(False)
    if bandwidth is not None:  # the transfers' model is a bound (tests/solvers/test_offload_solver.py)
        return _with_host_link(problem, budget, copies, oracle)
    rich = checked(problem, solve(problem, budget, "optimal",
                                  options("rich", max_copies=copies)), budget)
    assert rich.bound <= oracle.cost * (1 + 1e-9) + 1e-12
    assert rich.status is Status.OPTIMAL
    assert rich.cost == pytest.approx(oracle.cost, rel=1e-6, abs=1e-9)
    assert all(len(ps) <= copies for v, ps in rich.again.items()
               if problem.ops[v].kind is Kind.TENSOR)  # a tuple op runs for each tensor
    auto = checked(problem, solve(problem, budget, "optimal",
                                  options("auto", max_copies=copies)), budget)
    assert auto.cost == pytest.approx(oracle.cost, rel=1e-6, abs=1e-9)
    try:
        single = solve(problem, budget, "optimal", options("single"))
    except BudgetError:
        return
    assert rich.cost <= single.cost * (1 + 1e-9) + 1e-12


def _with_host_link(problem: Problem, budget: int, copies: int, oracle) -> None:
    """With a host link the rich model bounds the transfers' cost from above and prices its
    plan exactly: never below the exhaustive optimum, never above the best plan that does not
    offload (which it models exactly), its cost the overlap timeline's."""
    try:
        without = rich_brute_force(problem, budget, max_copies=copies, offload=False)
    except (BudgetError, ValueError):
        without = None
    for model in ("rich", "auto"):
        try:
            plan = checked(problem, solve(problem, budget, "optimal",
                                          options(model, max_copies=copies)), budget)
        except (BudgetError, SolverError):
            assert without is None, model  # only plans that need waits to fit are missed
            continue
        assert plan.cost >= oracle.cost * (1 - 1e-9) - 1e-12
        assert plan.cost == pytest.approx(price(problem, plan)[0], rel=1e-12, abs=1e-12)
        if without is not None:
            assert plan.cost <= without.cost * (1 + 1e-6) + 1e-9, model
