"""The slot relaxation's count rows (`remat.solvers.eager.count`) against brute force over
every cache subset: the least weighted count proven at a few slots never exceeds that of any
policy that fits, and the least cost's root bound under its row never exceeds the cheapest
policy's cost; one more than the least, as a row, breaks the second on some problem."""
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st
from ortools.sat.python import cp_model

from remat.solvers.eager.count import MAX_COUNT_WEIGHT, CountRows, count_weights
from remat.solvers.eager.decisions import TRUE, literal_value
from remat.solvers.eager.model import EagerModel
from remat.solvers.eager.search import eager_units
from remat.solvers.eager.slots import SlotRelaxation
from remat.solvers.core.deadline import Deadline
from tests.oracles.eager_brute import budget_between, eager_policies
from remat.solvers.core.options import SolverOptions
from tests.synthetic.eager import random_eager

OPTIONS = SolverOptions(time_limit=20, workers=2, cost_resolution=1e-9)


@given(st.lists(st.integers(0, 10 ** 9), max_size=40))
def test_weights_are_whole_quanta_of_the_costs(costs):
    quantum, weights = count_weights(costs)
    assert len(weights) == len(costs)
    if not any(costs):
        assert quantum == 0 and not any(weights)
        return
    assert quantum > 0
    for c, w in zip(costs, weights):
        assert 0 <= w <= MAX_COUNT_WEIGHT and quantum * w <= c < quantum * (w + 1)


def _solve(deadline):
    def solve(solver, m, stage):
        with deadline.guard(solver, stage):
            return solver.Solve(m)
    return solve


def _check(seed: int, stronger: int = 0, every: bool = False) -> tuple[list[str], int]:
    """What fails on one random problem, with the count's row `stronger` than proven (0: as
    proven): the least count above a fitting policy's, or the cost bound above the optimum;
    and the least count proven. At a few random slots, or at `every` slot."""
    problem, blocks = random_eager(seed, max_forward=10, max_backward=7, max_cacheable=8)
    _, budget = budget_between(problem, blocks, random.Random(seed).random() / 4)
    model = EagerModel(problem, blocks, eager_units(problem, blocks, OPTIONS))
    units = model.units
    relax = SlotRelaxation(model, units.capacity(budget))
    if not relax.quantum:
        return [], 0
    rng = random.Random(seed)
    few = rng.sample(range(model.slots), min(rng.randint(1, 3), model.slots))
    for t in range(model.slots) if every else few:
        relax.add_slot(t)
    moving = [(v, lit) for v, lit in model.runs_lit.items() if lit is not TRUE]
    _, weights = count_weights([units.cost_of(problem.ops[v].cost) for v, _ in moving])
    fitting = [s for s in eager_policies(problem, blocks) if s.peak <= budget]
    counts = [sum(w * literal_value(model.assignment(s.info["cached"]), lit)
                  for w, (_, lit) in zip(weights, moving)) for s in fitting]
    rows = CountRows(relax, OPTIONS, _solve(Deadline(20)))
    status, cached = rows.round(Deadline(20))
    assert status == cp_model.OPTIMAL and cached is not None
    failures = []
    if rows.least > min(counts) or (every and rows.least != min(counts)):
        failures.append(f"count {rows.least}, the least fitting {min(counts)}")
    if stronger:
        rows.least += stronger
        relax.m.Add(relax.count >= rows.least)
    bound = rows.cost_bound(Deadline(20))
    optimum = min(s.cost for s in fitting)
    if bound * units.cost + model.fixed_cost > optimum * (1 + 1e-9) + 1e-12:
        failures.append(f"bound {bound * units.cost + model.fixed_cost} above {optimum}")
    return failures, rows.least - stronger


@pytest.mark.parametrize("every", [False, True])
def test_the_count_rows_hold_for_every_policy(every):
    """At a few slots, a lower bound; at every slot, exactly the least count of a policy
    that fits."""
    checked = [_check(seed, every=every) for seed in range(40)]
    assert [failures for failures, _ in checked if failures] == []
    if every:
        assert sum(least > 0 for _, least in checked) >= 5  # some prove a count: not vacuous


def test_a_count_row_one_stronger_than_proven_breaks_the_bound():
    """The check above has teeth: with "count >= least + 1", some problem's bound exceeds its
    optimum (or nothing fits, an infinite bound)."""
    assert any(_check(seed, stronger=1)[0] for seed in range(16))
    assert any(_check(seed, stronger=1, every=True)[0] for seed in range(16))
