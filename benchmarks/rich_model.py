"""The single execution model (one recomputation per value, in the backward) against the
richer one, and both against an exhaustive search over the richer space, on CNN-shaped
synthetic graphs with long skip connections.

    PYTHONPATH=$PWD python benchmarks/rich_model.py                  # every graph and budget
    PYTHONPATH=$PWD python benchmarks/rich_model.py --graphs unet1 --fractions 0.9 --time-limit 20

For each graph and budget (fractions of the save-all peak, then the least peak of the single
model, and with --rich-least the least of the richer one, found by enumeration), one row: the
exact solver with `SolverOptions(model="single")` (cost, status, wall time), with
`model="rich"` (the same), the exhaustive search `rich_brute_force` (cost, time), and how far
the rich solver's cost is above the exhaustive optimum. Costs are recompute microseconds on
the synthetic roofline; "-" where a budget cannot be met ("BudgetError"); "refused" (and
"n/a") where the exhaustive search stops at its limits (`rich_brute.MAX_SHAPES`,
`MAX_SCHEDULES`). Wall times are on a shared machine: noisy.
"""
from __future__ import annotations

import argparse
import time

from tabulate import tabulate

from remat.errors import BudgetError, SolverError
from remat.solvers import SolverOptions, Strategy, make_schedule, solve
from tests.oracles.rich_brute import rich_brute_force, rich_smallest_peak
from tests.synthetic.cnn import skip_chain_problem, unet_problem

GRAPHS = {
    "unet1": lambda: unet_problem(1, seed=0),
    "unet1x2": lambda: unet_problem(1, convs=2, seed=0),
    "unet2": lambda: unet_problem(2, seed=0),
    "chain2x1": lambda: skip_chain_problem(2, 1, seed=0),
    "chain2x2": lambda: skip_chain_problem(2, 2, seed=0),
    "chain3x1": lambda: skip_chain_problem(3, 1, seed=1),
}


def us(seconds: float) -> str:
    return f"{seconds * 1e6:.4f}"


def timed(fn, *args, **kwargs):
    start = time.perf_counter()
    try:
        result = fn(*args, **kwargs)
    except (BudgetError, SolverError, ValueError) as error:
        result = error
    return result, time.perf_counter() - start


def outcome(result) -> tuple[str, str]:
    """(cost, status) of a schedule or an error."""
    if isinstance(result, Exception):
        return "-", type(result).__name__
    return us(result.cost), result.status.value


def budgets(problem, options: SolverOptions, fractions, rich_least: bool) -> list[tuple[str, int]]:
    high = make_schedule(problem, []).peak
    rows = [(f"{f:.0%}", int(f * high)) for f in fractions]
    single = timed(solve, problem, 0, Strategy.OPTIMAL, options)[0]
    if isinstance(single, BudgetError) and single.smallest:
        rows.append((f"least single ({single.smallest / high:.1%})", single.smallest))
    if rich_least:
        least, wall = timed(rich_smallest_peak, problem)
        if isinstance(least, int):
            rows.append((f"least rich ({least / high:.1%}, {wall:.0f} s)", least))
    return rows


def rows_of(name: str, fractions, time_limit: float, workers: int, rich_least: bool):
    problem = GRAPHS[name]()
    single_opts = SolverOptions(model="single", time_limit=time_limit, workers=workers)
    rich_opts = SolverOptions(model="rich", time_limit=time_limit, workers=workers)
    for label, budget in budgets(problem, single_opts, fractions, rich_least):
        single, single_s = timed(solve, problem, budget, Strategy.OPTIMAL, single_opts)
        rich, rich_s = timed(solve, problem, budget, Strategy.OPTIMAL, rich_opts)
        exhaustive, exhaustive_s = timed(rich_brute_force, problem, budget)
        if isinstance(exhaustive, ValueError):  # too many schedules to enumerate
            versus = "n/a"
        elif isinstance(exhaustive, Exception) or isinstance(rich, Exception):
            versus = "-" if type(rich) is type(exhaustive) else "differs"
        else:
            versus = (f"{(rich.cost - exhaustive.cost) / exhaustive.cost:+.2%}"
                      if exhaustive.cost else f"{rich.cost:+.2g} s")
        yield {
            "graph": f"{name} ({problem.num_forward}/{len(problem)})", "budget": label,
            "single cost": outcome(single)[0], "single status": outcome(single)[1],
            "single s": f"{single_s:.1f}",
            "rich cost": outcome(rich)[0], "rich status": outcome(rich)[1],
            "rich s": f"{rich_s:.1f}",
            "exhaustive cost": outcome(exhaustive)[0]
            if not isinstance(exhaustive, ValueError) else "refused",
            "exhaustive s": f"{exhaustive_s:.1f}", "rich vs exhaustive": versus,
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--graphs", nargs="+", default=list(GRAPHS), choices=list(GRAPHS))
    parser.add_argument("--fractions", nargs="+", type=float, default=[0.9, 0.8, 0.7, 0.6])
    parser.add_argument("--time-limit", type=float, default=60.0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rich-least", action="store_true",
                        help="add the richer model's least peak as a budget (an exhaustive "
                             "search of its own, which can take minutes)")
    args = parser.parse_args()
    rows = []
    for name in args.graphs:
        for row in rows_of(name, args.fractions, args.time_limit, args.workers,
                           args.rich_least):
            rows.append(row)
            print(" | ".join(str(v) for v in row.values()), flush=True)
    print(tabulate(rows, headers="keys"))


if __name__ == "__main__":
    main()
