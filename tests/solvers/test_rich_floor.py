"""The least peak quoted over the rich space: `peak_bound(rich=True)` against the exhaustive
search (`rich_smallest_peak`), and what BudgetError says under "auto", where the single model's
proofs do not hold (a value run twice, or again within the forward, may peak lower)."""
import re

import pytest

from remat.errors import BudgetError
from remat.solvers import solve
from remat.solvers.relaxation.bound import peak_bound
from remat.solvers.core.options import SolverOptions
from tests.oracles.rich_brute import rich_smallest_peak
from tests.synthetic.problems import random_problem

from tests.solvers.test_rich_solver import long_skip


def _least(problem) -> int | None:
    try:
        return rich_smallest_peak(problem, max_copies=2, offload=False)
    except ValueError:  # too many schedules to enumerate
        return None


def test_the_rich_peak_bound_never_exceeds_the_rich_least_peak():
    """Seeded random steps: the rich floor holds; the single one's (its joint steps: one
    decision a value) does not on some (seed 1: 345 against 286), which is why "auto" quotes
    the rich one."""
    checked, above = 0, 0
    for seed in range(60):
        problem = random_problem(seed, max_forward=6, max_backward=5)
        least = _least(problem)
        if least is None:
            continue
        checked += 1
        assert peak_bound(problem, time_limit=5, rich=True).value <= least, seed
        above += peak_bound(problem, time_limit=5).value > least
    assert checked >= 40 and above >= 1


@pytest.mark.parametrize("problem", [long_skip(skip=20, layer=5, grad=1),
                                     random_problem(1, max_forward=6, max_backward=5)],
                         ids=["long_skip", "random-1"])
def test_auto_quotes_only_what_holds_over_the_rich_space(problem):
    """Below the rich space's least peak, "auto" raises BudgetError; every peak it calls
    proven is at most that least peak (it called the single model's 32 bytes the least any
    schedule reaches, where the rich space reaches 27), and the peak it names fits."""
    least = _least(problem)
    with pytest.raises(BudgetError) as raised:
        solve(problem, least - 1, "optimal", SolverOptions(cost_resolution=1e-9, workers=2,
                                                            time_limit=20, model="auto"))
    message = str(raised.value)
    proven = [int(n.replace(",", "")) for n in re.findall(r"([\d,]+) bytes \(proven\)", message)]
    assert proven and all(p <= least for p in proven), message
    assert raised.value.smallest >= least
