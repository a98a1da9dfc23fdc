"""What the solver proves on compiled problems: status, bound and time of each solve.

For each model of benchmarks/inductor.py, the step is captured once as
`remat.optimize(..., compile=True)` captures it (Inductor's forms, the values Inductor fuses
into their readers named in the problem) and solved as it solves it (just-in-time positions,
least FLOPs, the default time limit unless `--time-limit`): at 1 byte, where the refusal names
the least peak found and says whether it is proven; then at budgets placed by `--fractions`
of the way from that least peak to the save-all peak, or at the bytes `--budgets` gives (one
list for every model: to compare two versions of the solver at the same budgets, pass the
budgets one run printed). Each row: the status, the recompute FLOPs of the plan, its cost and
the bound proven on it in the objective's units (FLOPs, seconds breaking ties), their gap, the seconds, and where the bound
came from. Simulated bytes, the graph's gradients included.

    python benchmarks/compiled_proofs.py [--models unet qwen2 llama] [--fractions 0 0.05 0.1
        0.2 0.4 | --budgets B ...] [--time-limit S]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tabulate import tabulate  # noqa: E402

from remat.errors import BudgetError  # noqa: E402
from remat.solvers import SolverOptions, make_schedule, simulate, solve  # noqa: E402


def row(name: str, fraction: str, problem, budget: int, options: SolverOptions) -> list:
    """One solve's row; its last entry (not printed) is the least peak a refusal names, else
    the plan's peak."""
    began = time.perf_counter()
    try:
        plan = solve(problem, budget, "optimal", options)
    except BudgetError as error:
        proven = "proven" if error.proven else "not proven"
        return [name, fraction, f"{budget:,}", f"refused: least {error.smallest:,} ({proven})",
                "", "", "", "", f"{time.perf_counter() - began:.1f}", "", error.smallest]
    # In the objective's units (FLOPs, seconds breaking ties), where the gap is proven.
    cost = plan.info.get("objective_cost", plan.cost)
    bound = plan.info.get("objective_bound", plan.bound)
    gap = (cost - bound) / cost if cost > 0 else 0.0
    return [name, fraction, f"{budget:,}", plan.status.value,
            f"{plan.recompute_flops / 1e9:.3f}", f"{cost:.4g}", f"{bound:.4g}",
            f"{100 * gap:.1f} %", f"{time.perf_counter() - began:.1f}",
            plan.info.get("bound_from", ""), plan.peak]


def main() -> None:
    import inductor
    from remat.planner.plans.prepare import prepare

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["unet", "qwen2", "llama"],
                        choices=sorted(inductor.MODELS))
    parser.add_argument("--fractions", nargs="+", type=float, default=[0, 0.05, 0.1, 0.2, 0.4])
    parser.add_argument("--budgets", nargs="+", type=int, default=None)
    parser.add_argument("--time-limit", type=float, default=None)
    args = parser.parse_args()
    options = SolverOptions(time_limit=args.time_limit, free_positions=False, objective="flops")
    rows = []
    for name in args.models:
        case = inductor.MODELS[name]()
        problem = prepare(case.model, case.args, example_kwargs=case.kwargs,
                          inductor=True).problem
        high = simulate(problem, make_schedule(problem, [])).peak
        rows.append(row(name, "1 byte", problem, 1, options))
        low = rows[-1][-1]
        print(f"{name}: {len(problem)} ops, {len(problem.fused_recomputations)} fusable values, "
              f"least found {low:,} B, save-all {high:,} B", flush=True)
        budgets = args.budgets or [low + int(f * (high - low)) for f in args.fractions]
        for budget in budgets:
            rows.append(row(name, f"{(budget - low) / (high - low):.3f}", problem, budget,
                            options))
            print(rows[-1][:-1], flush=True)
    print(tabulate([r[:-1] for r in rows], headers=[
        "model", "fraction", "budget B", "status", "GFLOP", "objective", "bound", "gap", "s",
        "bound from"]))


if __name__ == "__main__":
    main()
