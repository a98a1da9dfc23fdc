"""Re-solve the recorded corpus (tests/regression/*.json, written by record.py): the optimal
cost at each budget must not change beyond the cost rounding, nor the smallest peak."""
import pathlib

import pytest

from remat.errors import BudgetError
from remat.solvers import SolverOptions, simulate, solve
from remat.solvers.core.problem_file import loads

FILES = sorted((pathlib.Path(__file__).parents[1] / "regression").glob("*.json"))


def test_corpus_is_there():
    assert len(FILES) >= 5


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.stem)
def test_recorded_optimum(path):
    problem, extra = loads(path.read_text())
    # The corpus records the single model's optima and least peaks (the rich one goes lower).
    options = SolverOptions(workers=2, time_limit=60, model="single", **extra["options"])
    rounding = len(problem.candidates) * options.cost_resolution * problem.total_cost
    for case in extra["cases"]:
        if "smallest" in case:
            with pytest.raises(BudgetError) as error:
                solve(problem, case["budget"], "optimal", options)
            assert error.value.smallest == case["smallest"]
            continue
        result = solve(problem, case["budget"], "optimal", options)
        assert result.cost == pytest.approx(case["cost"], rel=1e-9, abs=rounding + 1e-15)
        assert result.peak <= case["budget"]
        assert result.peak == simulate(problem, result).peak
