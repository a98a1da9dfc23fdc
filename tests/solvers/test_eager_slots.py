"""The eager model's slot relaxation (`remat.solvers.eager.slots`) against brute force over
every cache subset: checked at any few slots, its least cost never exceeds the cheapest policy
that fits; checked at every slot, it is that policy's cost; and each slot's bytes are the eager
timeline's for every policy."""
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from ortools.sat.python import cp_model

from remat.errors import BudgetError
from remat.solvers.eager.decisions import TRUE, literal_value
from remat.solvers.eager.model import EagerModel
from remat.solvers.eager.search import eager_units
from remat.solvers.eager.slots import SlotRelaxation, overflowing, slot_bound, tightest
from remat.solvers.core.deadline import Deadline
from remat.solvers.timeline.eager import eager_schedule
from tests.oracles.eager_brute import budget_between, eager_brute_force
from remat.solvers.eager.heuristic import plan_eager
from remat.solvers.core.options import SolverOptions
from tests.synthetic.eager import random_eager

OPTIONS = SolverOptions(time_limit=20, workers=2, cost_resolution=1e-9)


def least_cost(relax: SlotRelaxation) -> float | None:
    """The relaxation's least cost in seconds (None: nothing fits at its slots)."""
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 2
    solver.parameters.max_time_in_seconds = 20
    status = solver.Solve(relax.m)
    if status == cp_model.INFEASIBLE:
        return None
    assert status == cp_model.OPTIMAL
    return solver.ObjectiveValue() * relax.full.units.cost + relax.full.fixed_cost


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2 ** 32 - 1), where=st.floats(0.0, 1.0))
def test_the_slot_bound_holds_and_is_exact_at_every_slot(seed, where):
    problem, blocks = random_eager(seed, max_forward=10, max_backward=7, max_cacheable=10)
    low, budget = budget_between(problem, blocks, where)
    oracle = eager_brute_force(problem, blocks, budget)
    model = EagerModel(problem, blocks, eager_units(problem, blocks, OPTIONS))
    assert model.units.exact_bytes
    capacity = model.units.capacity(budget)
    rng = random.Random(seed)
    for count in (1, 2, 4):  # a few slots: a lower bound
        relax = SlotRelaxation(model, capacity)
        for t in rng.sample(range(model.slots), min(count, model.slots)):
            relax.add_slot(t)
        found = least_cost(relax)
        assert found is not None and found <= oracle.cost * (1 + 1e-9) + 1e-12
    every = SlotRelaxation(model, capacity)
    for t in range(model.slots):
        every.add_slot(t)
    assert least_cost(every) == pytest.approx(oracle.cost, rel=1e-6, abs=1e-9)
    # Below the least peak, nothing fits at every slot.
    below = SlotRelaxation(model, model.units.capacity(low - 1))
    for t in range(model.slots):
        below.add_slot(t)
    assert least_cost(below) is None


@pytest.mark.parametrize("seed", range(12))
def test_each_slots_bytes_are_the_timelines(seed):
    """For random policies, the bytes the relaxation counts at a slot (its literals at their
    least) are the model's there, which are the eager timeline's: the peak over the slots is
    `eager_schedule`'s."""
    problem, blocks = random_eager(seed)
    model = EagerModel(problem, blocks, eager_units(problem, blocks, OPTIONS))
    relax = SlotRelaxation(model, 0)
    rng = random.Random(seed)
    decidable = sorted(model.decidable)
    for _ in range(16):
        cached = {v for v in decidable if rng.random() < 0.5}
        values = model.assignment(cached)
        levels = []
        for t in range(model.slots):
            level = model.fixed[t]
            for c, x in relax.level_terms(t):
                level += c * _least(relax, model, values, x)
            if model.active[t] is TRUE or literal_value(values, model.active[t]):
                levels.append(level)
        assert max(levels, default=0) * model.units.byte == \
            eager_schedule(problem, blocks, cached).peak


def _least(relax, model, values, x) -> int:
    """A relaxation literal's least value under the model's `values`: a model variable's own,
    or for a hold's boolean, whether any of its conditions holds."""
    for index, y in relax._vars.items():
        if y.Index() == x.Index():
            return values[index]
        if y.Index() == -x.Index() - 1:
            return 1 - values[index]
    for (i, k), y in relax._held.items():
        if y.Index() == x.Index():
            h = model.holds[i]
            return int(any(e >= k and all(literal_value(values, z) for z in lits)
                           for e, lits in h.terms if lits))
    raise AssertionError(f"unknown literal {x}")


def test_overflowing_takes_the_highest_run_first():
    levels = [1, 5, 7, 6, 1, 9, 8, 1, 4]
    assert overflowing(levels, 3, 1) == [5]
    assert overflowing(levels, 3, 2) == [5, 6]
    assert overflowing(levels, 10, 1) == []


def test_tightest_takes_the_highest_slot_of_each_run_near_the_capacity():
    levels = [1, 97, 99, 98, 1, 100, 1, 97, 96, 2]  # within 3 % of 100: runs 1-3, 5 and 7
    assert tightest(levels, 100, 2) == [5, 2]
    assert tightest(levels, 100, 5) == [5, 2, 7]
    assert tightest([1, 2], 100, 3) == []


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2 ** 32 - 1), where=st.floats(0.0, 1.0))
def test_the_rounds_from_a_policy_that_fits_bound_the_optimum(seed, where):
    """The rows generated from a start that fits (its tightest slots first) and the heuristic's
    repair: the bound never exceeds brute force's optimum, and a policy called optimal costs
    the optimum and fits."""
    problem, blocks = random_eager(seed, max_forward=10, max_backward=7, max_cacheable=10)
    _, budget = budget_between(problem, blocks, where)
    oracle = eager_brute_force(problem, blocks, budget)
    model = EagerModel(problem, blocks, eager_units(problem, blocks, OPTIONS))

    def heuristic(seeds):
        try:
            return plan_eager(problem, blocks, budget, seeds).info["cached"]
        except BudgetError:  # near the least peak, the heuristic may find nothing that fits
            return None

    start = heuristic([(), blocks.cacheable])

    def repair(cached):
        return heuristic([cached])

    deadline = Deadline(20)

    def solve(solver, m, stage):
        with deadline.guard(solver, stage):
            return solver.Solve(m)

    found = slot_bound(model, model.units.capacity(budget), OPTIONS, deadline,
                       starts=[] if start is None else [start],
                       solve=solve, repair=repair)
    # With no time for a round, a start that fits (here caching nothing, where that fits) is
    # what it returns (or caching all it decides, where that fits), optimal only if it is.
    start = () if eager_schedule(problem, blocks, ()).peak <= budget else None
    spent = slot_bound(model, model.units.capacity(budget), OPTIONS, Deadline(0),
                       starts=[] if start is None else [start], solve=solve, repair=repair)
    units = model.units
    for result in (found, spent):
        assert result.bound * units.cost + model.fixed_cost <= oracle.cost * (1 + 1e-9) + 1e-12
        if result.cached is not None:
            again = eager_schedule(problem, blocks, result.cached)
            assert again.peak <= budget
            if result.optimal:
                assert again.cost == pytest.approx(oracle.cost, rel=1e-6, abs=1e-9)
    assert spent.rounds == 0 and (start is None or spent.cached is not None)
