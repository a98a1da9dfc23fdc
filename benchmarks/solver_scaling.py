"""How the exact solver scales on synthetic transformer stacks, beside the baselines.

    python benchmarks/solver_scaling.py --sizes 505 2005 --fractions 0.5 0.45 0.4 --time-limit 60

For each size (ops) and budget (a fraction of the save-all peak): candidates, solve time, status,
gap, and each strategy's recompute cost (seconds on the synthetic roofline; "-" where it
cannot fit the budget). A budget no schedule fits shows the least peak the solver found, as a
fraction of the save-all peak: synthetic transformers bottom out between 40% and 50%.
"""
from __future__ import annotations

import argparse
import time

from tabulate import tabulate

from remat.errors import BudgetError, SolverError
from remat.solvers import SolverOptions, Strategy, make_schedule, simulate, solve
from remat.solvers.cpsat import BASELINES
from remat.solvers.synthetic import transformer_ops


def row(ops: int, fraction: float, options: SolverOptions) -> dict:
    problem = transformer_ops(ops)
    save_all_peak = simulate(problem, make_schedule(problem, [])).peak
    budget = int(fraction * save_all_peak)
    out = {"ops": len(problem), "candidates": len(problem.candidates), "budget": f"{fraction:.0%}"}
    start = time.perf_counter()
    try:
        best = solve(problem, budget, Strategy.OPTIMAL, options)
        out.update(time_s=round(time.perf_counter() - start, 1), status=best.status.value,
                   gap=f"{best.gap:.2%}" if best.gap is not None else "-",
                   bound_from=best.info.get("bound_from", "-"),
                   optimal=f"{best.cost * 1e3:.3f}")
    except (BudgetError, SolverError) as error:
        out.update(time_s=round(time.perf_counter() - start, 1), status=type(error).__name__,
                   gap="-", bound_from="-", optimal="-")
        smallest = getattr(error, "smallest", None)
        if smallest is not None:  # the least peak the solver found: the feasible floor
            out["status"] += f" (least {smallest / save_all_peak:.1%})"
    for strategy in BASELINES:
        try:
            out[strategy.value] = f"{solve(problem, budget, strategy).cost * 1e3:.3f}"
        except BudgetError:
            out[strategy.value] = "-"
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[500, 2000, 5000, 10000])
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.5, 0.25])
    parser.add_argument("--time-limit", type=float, default=60.0)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    options = SolverOptions(time_limit=args.time_limit, workers=args.workers)
    rows = []
    for size in args.sizes:
        for fraction in args.fractions:
            rows.append(row(size, fraction, options))
            print(tabulate([rows[-1]], headers="keys"), flush=True)
    print("\nrecompute cost in ms; '-' = does not fit the budget")
    print(tabulate(rows, headers="keys"))


if __name__ == "__main__":
    main()
