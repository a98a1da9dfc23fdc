"""The exact solver's single model against "auto" on problems larger than the exhaustive search
can take: the regression corpus's U-Net, chain and transformer, and two synthetic graphs.

    PYTHONPATH=$PWD python benchmarks/rich_vs_single.py [--time-limit 20]

For each problem, two budgets: the single model's smallest peak (where a second or a forward
recomputation pays most) and halfway from there to saving everything. Per budget and model
(`SolverOptions(model="single")`, `model="auto"`): recompute cost (the problem's units), status,
proven bound, wall seconds, and which model answered (`info["model"]`). "auto" runs the single
model first and the rich one only where the bound over the rich space leaves room, so where the
rich model cannot gain it costs the bound's time alone. 2 workers; a shared machine's times are
noisy.
"""
from __future__ import annotations

import argparse
import pathlib
import time

from tabulate import tabulate

from remat.errors import BudgetError
from remat.solvers import SolverOptions, solve
from remat.solvers.core.problem_file import loads
from remat.solvers.timeline.evaluate import make_schedule
from tests.synthetic.problems import transformer
from tests.synthetic.cnn import skip_chain_problem, unet_problem

REGRESSION = pathlib.Path(__file__).resolve().parent.parent / "tests" / "regression"


def problems():
    """(name, problem, solver options the problem was recorded with)."""
    for name in ("unet3", "chain12", "transformer2_nodrop"):
        problem, extra = loads((REGRESSION / f"{name}.json").read_text())
        yield name, problem, extra.get("options", {})
    yield "transformer(layers=2)", transformer(layers=2), {}
    yield "unet_problem(3)", unet_problem(3, seed=0), {}
    yield "skip_chain_problem(4, 2)", skip_chain_problem(4, 2, seed=0), {}


def smallest_single_peak(problem, options: SolverOptions) -> int:
    try:
        solve(problem, 0, "optimal", options)
    except BudgetError as e:
        return e.smallest
    return 0


def run(problem, budget: int, options: SolverOptions) -> list[str]:
    start = time.perf_counter()
    try:
        s = solve(problem, budget, "optimal", options)
    except BudgetError:
        return ["BudgetError", "-", "-", f"{time.perf_counter() - start:.1f}", "-"]
    return [f"{s.cost:.4g}", s.status.value, f"{s.bound:.4g}",
            f"{time.perf_counter() - start:.1f}", str(s.info.get("model", ""))]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--time-limit", type=float, default=20.0)
    args = parser.parse_args(argv)
    rows = []
    for name, problem, recorded in problems():
        single = SolverOptions(workers=2, time_limit=args.time_limit, model="single", **recorded)
        auto = SolverOptions(workers=2, time_limit=args.time_limit, model="auto", **recorded)
        full = make_schedule(problem, ()).peak
        least = smallest_single_peak(problem, single)
        for label, fraction in (("single's least", 0.0), ("halfway", 0.5)):
            budget = int(least + fraction * (full - least))
            one, both = run(problem, budget, single), run(problem, budget, auto)
            rows.append([name, len(problem), label, f"{budget:,}", *one[:4], *both])
            print(f"# {name} {label} done", flush=True)
    print(tabulate(rows, headers=["problem", "ops", "budget", "bytes", "single cost", "status",
                                  "bound", "s", "auto cost", "status", "bound", "s", "model"],
                   disable_numparse=True))


if __name__ == "__main__":
    main()
