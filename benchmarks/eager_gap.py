"""The exact eager search alone, on the zoo's eager problems: save each problem once, then
solve it again and again without capturing the model.

    # save the eager problems that examples/hf_zoo.py plans (its budgets, fraction 0.5)
    PYTHONPATH=$PWD python benchmarks/eager_gap.py --save /tmp/eager --archs dbrx,bamba
    # solve them with the exact eager search (optimal_eager) alone, 7.5 s each (what a 10 s
    # zoo row leaves it after the compiled seed and the heuristic)
    PYTHONPATH=$PWD python benchmarks/eager_gap.py --solve /tmp/eager --time-limit 7.5

Each saved file (pickle) holds what `plan_eager_mode` passed to `optimal_eager`: the eager
problem, its blocks, the budget, the options and the heuristic's policy (the hint). Solving
prints the status, cost, bound and gap (costs in the objective's units, seconds on the
target), the wall time and the load average at the start and end.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import pickle
import sys
import time
from pathlib import Path

from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from remat.solvers import SolverOptions  # noqa: E402
from remat.solvers.eager.search import optimal_eager  # noqa: E402
from remat.solvers.core.deadline import Deadline  # noqa: E402


def save(directory: Path, archs: list[str], time_limit: float) -> None:
    """Plan each architecture's eager row as the zoo does, saving the exact search's input."""
    import remat.solvers.entry as entry
    from examples import hf_zoo

    directory.mkdir(parents=True, exist_ok=True)
    exact = entry.optimal_eager
    for name in archs:
        def recording(problem, blocks, budget, options, *, hint=None, deadline=None,
                      name=name):
            with open(directory / f"{name}.pkl", "wb") as f:
                pickle.dump({"problem": problem, "blocks": blocks, "budget": budget,
                             "options": options,
                             "hint": None if hint is None else frozenset(hint)}, f)
            return exact(problem, blocks, budget, options, hint=hint, deadline=deadline)

        entry.optimal_eager = recording
        try:
            rows = hf_zoo.run_arch(name, SolverOptions(time_limit=time_limit),
                                   modes=("eager",), least=False)
        finally:
            entry.optimal_eager = exact
        for row in rows:
            print(name, row.status, row.gap, row.error or "", flush=True)


def solve(directory: Path, archs: list[str] | None, time_limit: float, workers: int | None
          ) -> None:
    rows = []
    for path in sorted(directory.glob("*.pkl")):
        if archs and path.stem not in archs:
            continue
        saved = pickle.loads(path.read_bytes())
        options = saved["options"]
        if workers:
            options = dataclasses.replace(options, workers=workers)
        load = os.getloadavg()[0]
        start = time.perf_counter()
        result = optimal_eager(saved["problem"], saved["blocks"], saved["budget"], options,
                               hint=saved["hint"], deadline=Deadline(time_limit))
        wall = time.perf_counter() - start
        info = result.info
        cost, bound = info["objective_cost"], info["objective_bound"]
        rows.append([path.stem, len(saved["problem"]), info.get("cache_units"),
                     result.status.value, f"{cost:.6g}", f"{bound:.6g}",
                     f"{(cost - bound) / cost:.2%}" if cost else "0",
                     f"{wall:.1f}", f"{load:.1f} -> {os.getloadavg()[0]:.1f}",
                     info.get("bound_from", "")])
        print(tabulate(rows[-1:], tablefmt="plain", disable_numparse=True), flush=True)
    print(tabulate(rows, headers=["arch", "ops", "units", "status", "cost", "bound", "gap",
                                  "wall s", "load", "bound from"], disable_numparse=True))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--save", type=Path, help="plan the zoo's eager rows and save each "
                        "exact search's input here")
    parser.add_argument("--solve", type=Path, help="solve the saved problems here")
    parser.add_argument("--archs", help="comma-separated (default: every saved one)")
    parser.add_argument("--time-limit", type=float, default=10.0)
    parser.add_argument("--workers", type=int)
    args = parser.parse_args(argv)
    archs = args.archs.split(",") if args.archs else None
    if args.save:
        save(args.save, archs or [], args.time_limit)
    if args.solve:
        solve(args.solve, archs, args.time_limit, args.workers)
    return 0


if __name__ == "__main__":
    sys.exit(main())
