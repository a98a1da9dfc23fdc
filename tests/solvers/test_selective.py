"""The selective baseline (Megatron's selective recomputation): it fits what it claims to fit,
recomputes no op that does FLOPs, is never cheaper than the optimum, and is in the pool of
hints of the exact solver. Also greedy's order, which must charge a value taken out of a tuple
op (attention's output) the tuple op's cost."""
import random
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, assume, given, settings, strategies as st

from remat.errors import BudgetError
from remat.solvers import Kind, Problem, SolverOptions, Status, Strategy, make_schedule, simulate, solve
from remat.solvers import cpsat
from remat.solvers.baselines.standard import does_flops, unit_cost
from remat.solvers.baselines.brute_force import MAX_CANDIDATES
from remat.solvers.core.problem import tuple_of
from remat.solvers.core.schedule import drop_unneeded, recomputable
from tests.synthetic.problems import Builder, random_problem, transformer

EXACT = SolverOptions(cost_resolution=1e-9, workers=2, time_limit=30)
S = 1000


def attention_step() -> Problem:
    """A projection (a matmul), attention (a tuple op that does FLOPs, whose outputs are
    getitems of cost zero) and a pointwise activation. The peak is at the first backward op,
    where none of them is read yet, so recomputing any one of them lowers it by its bytes:
    the activation costs 1 per 1,000 bytes, the projection 0.8, the attention 4."""
    g = Builder()
    qkv = g.add("qkv", [], 3 * S, flops=10 ** 9, cost=2.4, target="aten.mm.default")
    att = g.add("attention", [qkv], kind=Kind.TUPLE, temp=S, flops=10 ** 9, cost=4.0,
                target="aten._scaled_dot_product_flash_attention.default")
    out = g.add("attention.out", [att], S, cost=0.0)
    lse = g.add("attention.lse", [att], S // 100, cost=0.0)
    act = g.add("silu", [out], S, cost=1.0, target="aten.silu.default")
    loss = g.add("loss", [act], 4, cost=1.0, is_output=True)
    g.backward()
    head = g.add("head.bwd", [loss], 5 * S, cost=1.0)
    d = g.add("head.reduce", [head], S // 10, cost=1.0)
    d = g.add("silu.bwd", [d, act], S // 10, cost=1.0)
    d_qkv = g.add("attention.bwd", [d, qkv, out, lse], S // 10, flops=2 * 10 ** 9, cost=8.0)
    g.add("qkv.wgrad", [d_qkv], S // 10, cost=3.0, is_output=True)
    return g.problem("attention")


def index(problem: Problem, name: str) -> int:
    return next(i for i, op in enumerate(problem.ops) if op.name == name)


def peak_of(problem: Problem, names) -> int:
    return make_schedule(problem, [index(problem, n) for n in names]).peak


def outcome(problem, budget, strategy, options=EXACT):
    try:
        return solve(problem, budget, strategy, options)
    except BudgetError as error:
        return error


def test_the_attention_step_is_what_its_docstring_says():
    """The premise of the tests below: each single recomputation fits the budget of the
    activation's, and the attention's output is free by its own cost."""
    problem = attention_step()
    budget = peak_of(problem, ["silu"])
    assert budget < peak_of(problem, [])
    assert peak_of(problem, ["attention.out"]) <= budget
    assert peak_of(problem, ["qkv"]) <= budget
    out = index(problem, "attention.out")
    assert problem.ops[out].cost == 0.0
    assert unit_cost(problem, out) == problem.ops[index(problem, "attention")].cost
    assert does_flops(problem, out) and does_flops(problem, index(problem, "qkv"))
    assert not does_flops(problem, index(problem, "silu"))


def test_selective_recomputes_the_activation_not_the_matmul_nor_attention():
    problem = attention_step()
    budget = peak_of(problem, ["silu"])
    result = solve(problem, budget, Strategy.SELECTIVE)
    assert result.recomputed == {index(problem, "silu")}
    assert result.cost == problem.ops[index(problem, "silu")].cost
    assert result.peak <= budget
    assert result.strategy == "selective" and result.status is Status.HEURISTIC
    # Here that is the optimum.
    assert result.cost == pytest.approx(solve(problem, budget, Strategy.BRUTE_FORCE).cost)


def test_greedy_charges_a_getitem_its_tuple_op():
    """By its own cost of zero, attention's output would come first in greedy's order and
    bring the attention (cost 4) with it; by what recomputing it costs, it comes last."""
    problem = attention_step()
    budget = peak_of(problem, ["silu"])
    result = solve(problem, budget, Strategy.GREEDY)
    assert index(problem, "attention") not in result.recomputed
    assert result.cost < problem.ops[index(problem, "attention")].cost


def test_the_exact_solver_starts_from_selective_when_it_is_cheapest():
    problem = attention_step()
    budget = peak_of(problem, ["silu"])
    assert Strategy.SELECTIVE in cpsat.BASELINES
    best = cpsat._best_baseline(problem, budget, EXACT)
    assert best.cost <= solve(problem, budget, Strategy.SELECTIVE).cost
    assert best.cost < solve(problem, budget, Strategy.GREEDY).cost  # selective's, not greedy's


def test_budget_error_says_the_smallest_peak_it_reaches():
    problem = transformer(layers=2, seq=64, d_model=64, heads=2, batch=2, dropout=False)
    with pytest.raises(BudgetError) as error:
        solve(problem, 0, Strategy.SELECTIVE)
    smallest = error.value.smallest
    assert smallest is not None and smallest > 0
    assert "selective" in str(error.value) and f"{smallest:,}" in str(error.value)
    at_smallest = solve(problem, smallest, Strategy.SELECTIVE)
    assert at_smallest.peak <= smallest
    with pytest.raises(BudgetError):
        solve(problem, smallest - 1, Strategy.SELECTIVE)


def test_on_a_transformer_keeps_every_matmul_and_fits():
    """Between the peak of recomputing every memory-bound value and saving all: it fits
    without a single op that does FLOPs, as cheaply as recomputing all of those or cheaper."""
    problem = transformer(layers=3, seq=128, d_model=64, heads=2, batch=2, dropout=False)
    cheap = [v for v in recomputable(problem) if not does_flops(problem, v)]
    assert cheap and any(does_flops(problem, v) for v in recomputable(problem))
    all_cheap = make_schedule(problem, drop_unneeded(problem, cheap))
    save_all = make_schedule(problem, [])
    assert all_cheap.peak < save_all.peak
    for where in (0.0, 0.3, 0.7):
        budget = all_cheap.peak + int(where * (save_all.peak - all_cheap.peak))
        result = solve(problem, budget, Strategy.SELECTIVE)
        assert result.peak <= budget
        assert not any(does_flops(problem, v) for v in result.recomputed)
        assert result.recompute_flops == 0
        assert result.cost <= all_cheap.cost


def with_flops(problem: Problem, seed: int) -> Problem:
    """`problem` with about a third of its forward ops marked as doing FLOPs."""
    rng = random.Random(seed)
    ops = tuple(replace(op, flops=rng.choice((0, 0, 10 ** 6))) if i < problem.num_forward else op
                for i, op in enumerate(problem.ops))
    return Problem(ops, name=problem.name)


small = st.builds(lambda seed, f, b, marks: with_flops(
                      random_problem(seed, max_forward=f, max_backward=b), marks),
                  st.integers(0, 2 ** 32 - 1), st.integers(1, 12), st.integers(0, 7),
                  st.integers(0, 2 ** 32 - 1))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problem=small, where=st.floats(0.0, 1.05))
def test_against_brute_force(problem, where):
    """A heuristic: whatever it returns fits and is simulated, recomputes nothing that does
    FLOPs, and costs at least the optimum; where it refuses, the smallest peak it names is one
    it meets, and no lower than the smallest any schedule reaches."""
    assume(len(recomputable(problem)) <= MAX_CANDIDATES)
    save_all = make_schedule(problem, []).peak
    budget = int(where * save_all)
    try:
        oracle = outcome(problem, budget, Strategy.BRUTE_FORCE)
    except ValueError:  # too many schedules to enumerate
        assume(False)
    result = outcome(problem, budget, Strategy.SELECTIVE)
    if isinstance(result, BudgetError):
        assert result.smallest > budget
        if isinstance(oracle, BudgetError):
            assert result.smallest >= oracle.smallest
        assert solve(problem, result.smallest, Strategy.SELECTIVE).peak <= result.smallest
        return
    assert result.peak <= budget
    assert result.peak == simulate(problem, result).peak
    assert not any(does_flops(problem, v) for v in result.recomputed)
    assert all(tuple_of(problem, v) is None or tuple_of(problem, v) in result.recomputed
               for v in result.recomputed)
    assert not isinstance(oracle, BudgetError)  # selective's schedule is a witness
    assert result.cost >= oracle.cost - 1e-9
    if budget >= save_all:
        assert result.cost == 0 and not result.recomputed
