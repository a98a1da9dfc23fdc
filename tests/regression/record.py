"""(Re)record the regression corpus: synthetic problems with the optimal cost at a few budgets.

    python tests/regression/record.py            # every file
    python tests/regression/record.py chain6     # one

Each file is a problem file (remat.solvers.core.problem_file) whose extra field "cases" lists
{"budget", "cost", "peak"} for a solved budget or {"budget", "smallest"} for one that no schedule
fits. Record only answers proven OPTIMAL: the test re-solves and compares.
"""
from __future__ import annotations

import pathlib
import sys

from remat.errors import BudgetError
from remat.solvers import SolverOptions, Status, make_schedule, simulate, solve
from remat.solvers.core.problem_file import dumps
from tests.synthetic.problems import chain, diamond, transformer, unet

HERE = pathlib.Path(__file__).parent
OPTIONS = SolverOptions(workers=2, time_limit=60, cost_resolution=1e-6)
FRACTIONS = (1.0, 0.85, 0.7, 0.5, 0.35, 0.1)
PROBLEMS = {
    "chain6": lambda: chain(6),
    "chain12": lambda: chain(12, width=512),
    "diamond": diamond,
    "unet3": lambda: unet(3),
    "transformer1": lambda: transformer(1, seq=256, d_model=256, heads=4),
    "transformer2_nodrop": lambda: transformer(2, seq=128, d_model=128, heads=2, dropout=False),
}


def record(name: str) -> pathlib.Path:
    problem = PROBLEMS[name]()
    full = simulate(problem, make_schedule(problem, [])).peak
    cases = []
    for fraction in FRACTIONS:
        budget = int(full * fraction)
        try:
            result = solve(problem, budget, "optimal", OPTIONS)
        except BudgetError as error:
            cases.append({"budget": budget, "smallest": error.smallest})
            continue
        if result.status is not Status.OPTIMAL:
            continue
        cases.append({"budget": budget, "cost": result.cost, "peak": result.peak})
    path = HERE / f"{name}.json"
    path.write_text(dumps(problem, cases=cases, options={"cost_resolution": OPTIONS.cost_resolution}))
    return path


if __name__ == "__main__":
    for name in sys.argv[1:] or PROBLEMS:
        print(record(name))
