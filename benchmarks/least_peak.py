"""The least peak BudgetError names, and whether the next call meets it.

For each model of benchmarks/inductor.py, the step is captured once and its problem solved as
`remat.optimize(..., compile=True)` solves it (just-in-time positions, least FLOPs): first at a
budget of 1 byte, where the BudgetError names the least peak found; then at that figure, which
should now plan. Simulated peaks, the graph's gradients included, in MiB.

    python benchmarks/least_peak.py [--models qwen2 vit] [--time-limit 60] [--deterministic]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from remat.errors import BudgetError  # noqa: E402
from remat.solvers import SolverOptions, solve  # noqa: E402

MIB = 2 ** 20


def asked(problem, budget: int, options: SolverOptions) -> tuple[str, int | None, float]:
    """What a call at `budget` says, the bytes a refusal names, and the call's seconds."""
    began = time.perf_counter()
    try:
        plan = solve(problem, budget, "optimal", options)
        return f"plans {plan.peak / MIB:.3f}", None, time.perf_counter() - began
    except BudgetError as error:
        return (f"refused, names {error.smallest / MIB:.3f}", error.smallest,
                time.perf_counter() - began)


def main() -> None:
    import inductor
    from remat.planner.plans.prepare import prepare

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["qwen2", "vit"],
                        choices=sorted(inductor.MODELS))
    parser.add_argument("--time-limit", type=float, default=60.0)
    parser.add_argument("--deterministic", action="store_true")
    args = parser.parse_args()
    options = SolverOptions(time_limit=args.time_limit, free_positions=False, objective="flops",
                            deterministic=True if args.deterministic else None)
    print("| model | ops | at 1 byte | s | at the figure named | s |")
    print("|---|---|---|---|---|---|")
    for name in args.models:
        case = inductor.MODELS[name]()
        problem = prepare(case.model, case.args, example_kwargs=case.kwargs).problem
        first, named, first_s = asked(problem, 1, options)
        second, _, second_s = (asked(problem, named, options) if named is not None
                               else ("", None, 0.0))
        print(f"| {name} | {len(problem)} | {first} | {first_s:.1f} | {second} | "
              f"{second_s:.1f} |", flush=True)


if __name__ == "__main__":
    main()
