"""The exact eager planner (`remat.solvers.eager.search`): its model's bytes are the eager
timeline's for every policy, its optimum is brute force's over every cache subset, it is never
worse than the heuristic it starts from, and it keeps to its deadline."""
import itertools
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from remat.errors import BudgetError
from remat.solvers.core.schedule import OPTIMAL_TOLERANCE
from remat.solvers.eager.model import EagerModel
from remat.solvers.eager.search import eager_units, least_eager_peak, optimal_eager
from remat.solvers.core.deadline import Deadline
from remat.solvers.timeline.eager import eager_schedule
from remat.solvers.timeline.eager_blocks import EagerBlocks
from remat.solvers.eager.heuristic import cheapest_prefix, plan_eager
from tests.oracles.eager_brute import budget_between, eager_brute_force
from remat.solvers.core.options import SolverOptions
from remat.solvers.core.problem import Kind
from remat.solvers.core.schedule import Status
from tests.synthetic.eager import random_eager

OPTIONS = SolverOptions(time_limit=20, workers=2, cost_resolution=1e-9)
SLOW = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])


def holds_the_timeline(seed: int, policies: int = 64, decisions: bool = False) -> None:
    """For every policy (`policies` drawn) of a random structure, the model's own holds (at the
    least values of its literals) peak where `eager_timeline` does, to the byte; and what the
    model cannot decide never pays: caching it on top of a policy costs no less and peaks no
    lower than the policy alone."""
    problem, blocks = random_eager(seed, decisions=decisions)
    model = EagerModel(problem, blocks, eager_units(problem, blocks, OPTIONS))
    assert model.units.exact_bytes
    decidable = sorted(model.decidable)
    subsets = [c for k in range(len(decidable) + 1)
               for c in itertools.combinations(decidable, k)]
    rng = random.Random(seed)
    for cached in rng.sample(subsets, min(len(subsets), policies)):
        assert model.peak_of(cached) * model.units.byte == \
            eager_schedule(problem, blocks, cached).peak, cached
    for _ in range(policies // 4):
        cached = [v for v in sorted(blocks.cacheable) if rng.random() < 0.5]
        alone = eager_schedule(problem, blocks, model.decidable.intersection(cached))
        more = eager_schedule(problem, blocks, cached)
        assert alone.cost <= more.cost and alone.peak <= more.peak, cached


@settings(max_examples=150, **SLOW)
@given(seed=st.integers(0, 2 ** 32 - 1))
def test_the_model_holds_what_the_eager_timeline_holds(seed):
    holds_the_timeline(seed)


def test_the_model_holds_the_decisions_every_policy_caches_as_the_timeline():
    """Ops that may not be recomputed yet are cacheable (routing decisions): every policy
    caches them, and the model holds them as cached values, as `eager_timeline` does. Seeds
    in order: about one structure in ten holds such a value where the peak sees it."""
    for seed in range(64):
        holds_the_timeline(seed, policies=16, decisions=True)


@pytest.mark.parametrize("seed", [
    136056,  # a tuple op recomputed, its first tensor cached: the second is made at its own step
    136095,  # a tensor past the early stop, cached with its sibling, spares their tuple op's run
])
def test_the_model_holds_what_the_eager_timeline_holds_where_it_once_did_not(seed):
    holds_the_timeline(seed, policies=1024)


def checked(problem, blocks, schedule, budget):
    """The schedule is the eager timeline's for its policy, fits, and its status is true."""
    again = eager_schedule(problem, blocks, schedule.info["cached"])
    assert schedule.peak == again.peak <= budget and schedule.cost == again.cost
    assert schedule.bound is not None and schedule.bound <= schedule.cost * (1 + 1e-9) + 1e-12
    if schedule.status is Status.OPTIMAL:
        assert schedule.cost - schedule.bound <= OPTIMAL_TOLERANCE * schedule.cost + 1e-12
    return schedule


@settings(max_examples=80, **SLOW)
@given(seed=st.integers(0, 2 ** 32 - 1), where=st.floats(0.0, 1.0))
def test_the_optimum_is_brute_force_and_never_worse_than_the_heuristic(seed, where):
    problem, blocks = random_eager(seed, max_forward=11, max_backward=8, max_cacheable=11)
    low, budget = budget_between(problem, blocks, where)
    oracle = eager_brute_force(problem, blocks, budget)
    seed = cheapest_prefix(problem, blocks, budget)
    if eager_schedule(problem, blocks, ()).peak <= budget:  # the bisection starts from a fit
        assert eager_schedule(problem, blocks, seed).peak <= budget
    try:
        heuristic = plan_eager(problem, blocks, budget, [seed, (), blocks.cacheable])
    except BudgetError:
        heuristic = None
    exact = checked(problem, blocks, optimal_eager(
        problem, blocks, budget, OPTIONS,
        hint=None if heuristic is None else heuristic.info["cached"]), budget)
    assert exact.status is Status.OPTIMAL
    assert exact.cost == pytest.approx(oracle.cost, rel=1e-6, abs=1e-9)
    if heuristic is not None:
        assert exact.cost <= heuristic.cost * (1 + 1e-9) + 1e-12
    with pytest.raises(BudgetError) as raised:
        optimal_eager(problem, blocks, low - 1, OPTIONS)
    assert raised.value.smallest == low  # proven: the least eager peak of any policy
    least, floor = least_eager_peak(problem, blocks, OPTIONS)
    assert least.peak == floor == low


def test_caching_a_reader_of_the_recomputation_is_worth_it_only_where_it_fits():
    """A hand-made block: x -> a -> b, the backward reads a and b. Caching both recomputes
    nothing and holds both through the forward; caching neither recomputes both at the
    trigger; the exact plan at each budget is the cheapest policy whose peak fits."""
    from remat.solvers.core.problem import Op, Phase, Problem

    F, B = Phase.FORWARD, Phase.BACKWARD
    ops = [Op("x", F, (), size=4, cost=1.0),
           Op("a", F, (0,), size=8, cost=5.0),
           Op("b", F, (1,), size=6, cost=3.0),
           Op("loss", F, (2,), size=1, cost=1.0, is_output=True),
           Op("gb", B, (3, 2), size=6, cost=1.0),
           Op("ga", B, (4, 1), size=8, cost=1.0),
           Op("gx", B, (5, 0), size=4, cost=1.0, is_output=True)]
    problem = Problem(ops)
    blocks = EagerBlocks(ops={"layer": (1, 2)}, owner={4: "layer", 5: "layer"},
                         cacheable=frozenset({1, 2}))
    policies = {c: eager_schedule(problem, blocks, c) for c in ((), (1,), (2,), (1, 2))}
    for budget in sorted({s.peak for s in policies.values()}):
        fitting = [s for s in policies.values() if s.peak <= budget]
        best = min(fitting, key=lambda s: (s.cost, s.peak))
        exact = checked(problem, blocks, optimal_eager(problem, blocks, budget, OPTIONS), budget)
        assert exact.status is Status.OPTIMAL and exact.cost == best.cost


class _Clock:
    """A clock that jumps `step` seconds at each reading: a slow machine, without waiting."""

    def __init__(self, step: float):
        self.now, self.step = 0.0, step

    def __call__(self) -> float:
        self.now += self.step
        return self.now


def test_a_spent_deadline_returns_the_hint_with_what_is_proven():
    problem, blocks = random_eager(7)
    budget = eager_schedule(problem, blocks, blocks.cacheable).peak
    hint = tuple(sorted(blocks.cacheable))
    spent = Deadline(1.0, clock=_Clock(10.0))  # past its end at the first look
    found = optimal_eager(problem, blocks, budget, OPTIONS, hint=hint, deadline=spent)
    assert found.info["cached"] == eager_schedule(problem, blocks, hint).info["cached"]
    assert found.status is Status.FEASIBLE or found.cost == 0
    assert found.bound == 0.0 and spent.stopped[0].startswith("eager")
    # Without a hint: per-block checkpointing where it fits (HEURISTIC), else BudgetError
    # naming its peak as found.
    blocks_plan = eager_schedule(problem, blocks, ())
    try:
        alone = optimal_eager(problem, blocks, budget, OPTIONS,
                              deadline=Deadline(1.0, clock=_Clock(10.0)))
    except BudgetError as error:
        assert blocks_plan.peak > budget
        assert error.proven is False and error.smallest == blocks_plan.peak
    else:
        assert alone.info["cached"] == blocks_plan.info["cached"]
        assert alone.status is Status.HEURISTIC or alone.cost == 0


def test_the_structure_it_assumes_is_checked():
    problem, blocks = random_eager(1)  # draws tuple ops
    tuples = [v for v in range(problem.num_forward) if problem.ops[v].kind is Kind.TUPLE]
    assert tuples
    bad = EagerBlocks(ops=blocks.ops, owner=blocks.owner, cacheable=frozenset(tuples))
    with pytest.raises(ValueError, match="tuple op"):
        EagerModel(problem, bad, eager_units(problem, bad, OPTIONS))
