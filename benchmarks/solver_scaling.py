"""How the exact solver and the baselines scale on synthetic transformer stacks, up to 20k ops.

    python benchmarks/solver_scaling.py --load 2    # default options, 2 busy processes beside
    python benchmarks/solver_scaling.py --sizes 500 2000 5000 10000 20000 --fractions 0.7 0.5 \
        --time-limit 60
    python benchmarks/solver_scaling.py --sizes 500 2000 --fractions 0.7 --time-limit 10  # short

With no --time-limit the solver runs with its defaults, limits chosen by problem size (the
"limit" column: seconds and relative gap), on the wall clock unless --deterministic. `--load N`
starts N busy processes (pure-Python spin loops, killed at the end) beside the solves, to see
the deadline hold on a loaded machine: "wall_s" is the optimal strategy's wall time over its
limit.

For each size (ops) and budget (a fraction of the save-all peak), one row: the optimal
strategy's wall time next to its limit, status, cost, proven bound and gap; then each baseline's
cost and time (greedy, selective, tiled, checkpoint_blocks). `--hint-tiled` adds the optimal
strategy started from the tiled plan. Costs are recompute milliseconds on the synthetic
roofline; "-" where a strategy cannot fit the budget. A budget no schedule fits shows the least
peak the solver found, as a fraction of the save-all peak (synthetic transformers bottom out
between 40% and 50%). Timings are wall clock: on a shared machine, say how busy it was.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import replace

from tabulate import tabulate

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _load import busy  # noqa: E402

from remat.errors import BudgetError, SolverError  # noqa: E402
from remat.solvers import Schedule, SolverOptions, Strategy, make_schedule, solve  # noqa: E402
from tests.synthetic.problems import transformer_ops  # noqa: E402

BASELINES = (Strategy.GREEDY, Strategy.SELECTIVE, Strategy.TILED, Strategy.CHECKPOINT_BLOCKS)


def ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.3f}"


def timed(problem, budget, strategy, options) -> tuple[Schedule | Exception, float]:
    start = time.perf_counter()
    try:
        return solve(problem, budget, strategy, options), time.perf_counter() - start
    except (BudgetError, SolverError) as error:
        return error, time.perf_counter() - start


def exact_columns(result, wall: float, options: SolverOptions, problem, save_all_peak: int,
                  prefix: str) -> dict:
    sized = options.by_size(len(problem))
    out = {f"{prefix}limit": f"{sized.time_limit:g} s, {sized.relative_gap:.0%}",
           f"{prefix}wall_s": f"{wall:.1f}/{sized.time_limit:g}"}
    if isinstance(result, Exception):
        status = type(result).__name__
        smallest = getattr(result, "smallest", None)
        if smallest is not None:  # the least peak the solver found: the feasible floor
            status += f" (least {smallest / save_all_peak:.1%})"
        return {**out, f"{prefix}status": status, f"{prefix}cost": "-", f"{prefix}bound": "-",
                f"{prefix}gap": "-"}
    repeatable = result.info.get("deterministic")
    return {**out, f"{prefix}status": result.status.value, f"{prefix}cost": ms(result.cost),
            f"{prefix}bound": ms(result.bound),
            f"{prefix}gap": "-" if result.gap is None else f"{result.gap:.2%}",
            f"{prefix}repeatable": "-" if repeatable is None else
            "yes" if repeatable is True else "cut"}


def row(ops: int, fraction: float, options: SolverOptions, hint_tiled: bool) -> dict:
    problem = transformer_ops(ops)
    save_all_peak = make_schedule(problem, []).peak
    budget = int(fraction * save_all_peak)
    out = {"ops": len(problem), "candidates": len(problem.candidates), "budget": f"{fraction:.0%}"}
    result, wall = timed(problem, budget, Strategy.OPTIMAL, options)
    out.update(exact_columns(result, wall, options, problem, save_all_peak, ""))
    found = {}
    for strategy in BASELINES:
        found[strategy], seconds = timed(problem, budget, strategy, options)
        cost = found[strategy].cost if isinstance(found[strategy], Schedule) else None
        out[strategy.value] = f"{ms(cost)} ({seconds:.1f}s)"
    tiled = found[Strategy.TILED]
    if hint_tiled and isinstance(tiled, Schedule):
        hinted, wall = timed(problem, budget, Strategy.OPTIMAL, replace(options, hint=tiled))
        out.update(exact_columns(hinted, wall, options, problem, save_all_peak, "hinted_"))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[500, 2000, 5000, 10000, 20000])
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.7, 0.5])
    parser.add_argument("--time-limit", type=float, default=None,
                        help="seconds per solve (default: the solver's, by problem size)")
    parser.add_argument("--relative-gap", type=float, default=None,
                        help="stop once proven this close (default: the solver's, by size)")
    parser.add_argument("--deterministic", action="store_true",
                        help="plan on deterministic time (SolverOptions(deterministic=True))")
    parser.add_argument("--load", type=int, default=0,
                        help="busy processes (spin loops) to run beside the solves")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--model", choices=("auto", "single", "rich"), default="auto",
                        help="the exact solver's execution model (SolverOptions.model); under "
                             "auto the bound and gap are over the rich space")
    parser.add_argument("--hint-tiled", action="store_true",
                        help="also run the optimal strategy started from the tiled plan")
    args = parser.parse_args()
    options = SolverOptions(time_limit=args.time_limit, relative_gap=args.relative_gap,
                            workers=args.workers, model=args.model,
                            deterministic=args.deterministic)
    rows = []
    with busy(args.load):
        print(f"{args.load} busy processes beside; load average {os.getloadavg()[0]:.1f} on "
              f"{os.cpu_count()} CPUs", flush=True)
        for size in args.sizes:
            for fraction in args.fractions:
                rows.append(row(size, fraction, options, args.hint_tiled))
                print(tabulate([rows[-1]], headers="keys"), flush=True)
        load = os.getloadavg()[0]
    print(f"\ncosts in recompute ms (baselines: ms (seconds)); '-' = does not fit the budget; "
          f"limit = the time limit and relative gap; wall_s = optimal's wall time / its time "
          f"limit; repeatable = deterministic and not cut by the wall clock; {args.load} busy "
          f"processes, load average {load:.1f} at the end")
    print(tabulate(rows, headers="keys"))


if __name__ == "__main__":
    main()
