"""The slot relaxation's few rows per storage (`remat.solvers.eager.conditions`): for
every policy, storage and slot, the disjunction of the reduced conditions (each "some slot
from c to e runs" boolean at its least: whether one of those slots runs) is exactly the
model's own, every term that holds it to that slot or later. Against brute force, the bound
that the relaxation gives with them is checked in tests/solvers/test_eager_slots.py."""
import random

import pytest

from remat.solvers.eager.decisions import literal_value
from remat.solvers.eager.model import EagerModel
from remat.solvers.eager.search import eager_units
from remat.solvers.eager.slots import SlotRelaxation
from remat.solvers.core.options import SolverOptions
from tests.synthetic.eager import random_eager

OPTIONS = SolverOptions(time_limit=20, workers=2, cost_resolution=1e-9)


def _least(relax, model, values, x) -> int:
    """A relaxation literal's least value under the model's `values`."""
    conditions = relax._conditions
    for index, y in relax._vars.items():
        if y.Index() == x.Index():
            return values[index]
        if y.Index() == -x.Index() - 1:
            return 1 - values[index]
    if x.Index() in conditions.some_running:
        c, e = conditions.some_running[x.Index()]
        return int(any(literal_value(values, model.active[k]) for k in range(c, e + 1)))
    raise AssertionError(f"unknown literal {x}")


@pytest.mark.parametrize("seed", range(40))
def test_the_reduced_conditions_hold_exactly_when_the_terms_do(seed):
    problem, blocks = random_eager(seed, max_forward=12, max_backward=9, max_cacheable=12)
    model = EagerModel(problem, blocks, eager_units(problem, blocks, OPTIONS))
    relax = SlotRelaxation(model, 0)
    rng = random.Random(seed)
    decidable = sorted(model.decidable)
    for _ in range(12):
        cached = {v for v in decidable if rng.random() < 0.5}
        values = model.assignment(cached)
        for i, h in enumerate(model.holds):
            for t in range(h.start, model.slots):
                terms = [lits for k, lits in h.terms if k >= t and lits]
                expected = any(all(literal_value(values, x) for x in lits) for lits in terms)
                got = any(all(_least(relax, model, values, x) for x in lits)
                          for lits in relax._conditions.of(i, t))
                assert got == expected, (i, t, sorted(cached))


def test_the_conditions_are_fewer_than_the_terms():
    """The reduction happens on these structures (else the test above would check nothing
    of it): both shapes, and fewer rows in all."""
    terms = rows = chains = 0
    for seed in range(40):
        problem, blocks = random_eager(seed, max_forward=12, max_backward=9, max_cacheable=12)
        model = EagerModel(problem, blocks, eager_units(problem, blocks, OPTIONS))
        relax = SlotRelaxation(model, 0)
        for i, h in enumerate(model.holds):
            for t in range(h.start, model.slots):
                terms += sum(1 for k, lits in h.terms if k >= t and lits)
                rows += len(relax._conditions.of(i, t))
        chains += sum(1 for c, e in relax._conditions.some_running.values() if e > c)
    assert chains > 0 and rows < terms
