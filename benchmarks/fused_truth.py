"""The solver's claims on problems with fused recomputations, against brute force.

Random problems (`tests.synthetic.problems.random_problem`) with about half their forward
values made ones a compiled step fuses into their readers (`with_free_values`), solved in the
just-in-time space that compiled plans are solved in, at three budgets between the least peak
and save-all's and at the least peak less one byte. Brute force (`Strategy.BRUTE_FORCE`)
judges each answer: a bound above a cost it reaches, an OPTIMAL above its optimum, a refusal
of a budget a plan meets, or a least peak named as proven that is not the least. Prints the
counts: plans, how many OPTIMAL, refusals, how many proven, and every wrong claim.

    python benchmarks/fused_truth.py [--seeds 150] [--time-limit 10]
"""
from __future__ import annotations

import argparse
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from remat.errors import BudgetError  # noqa: E402
from remat.solvers import SolverOptions, Strategy, make_schedule, simulate, solve  # noqa: E402
from remat.solvers.core.schedule import OPTIMAL_TOLERANCE, Status  # noqa: E402
from tests.synthetic.problems import random_problem, with_free_values  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=150)
    parser.add_argument("--time-limit", type=float, default=10.0)
    args = parser.parse_args()
    options = SolverOptions(time_limit=args.time_limit, workers=2, cost_resolution=1e-9,
                            free_positions=False)
    counts = dict(plans=0, optimal=0, refusals=0, proven=0, wrong=0)
    for seed in range(args.seeds):
        rng = random.Random(seed)
        problem = with_free_values(random_problem(seed, max_forward=rng.randint(2, 10),
                                                  max_backward=rng.randint(1, 6)), rng)
        if not problem.fused_recomputations:
            continue
        try:
            low = solve(problem, 0, Strategy.BRUTE_FORCE, options).peak
        except ValueError:
            continue  # too many schedules to enumerate
        except BudgetError as error:
            low = error.smallest
        high = simulate(problem, make_schedule(problem, [])).peak
        for where in (0.0, 0.3, 0.7):
            budget = low + int(where * (high - low))
            oracle = solve(problem, budget, Strategy.BRUTE_FORCE, options)
            for asked in (budget, budget - 1) if where == 0 else (budget,):
                wrong = judge(problem, asked, low, oracle.cost, options, counts)
                if wrong:
                    counts["wrong"] += 1
                    print(f"seed {seed}, budget {asked:,}: {wrong}", flush=True)
    print(", ".join(f"{k} {v}" for k, v in counts.items()))


def judge(problem, budget: int, low: int, optimum: float, options: SolverOptions,
          counts: dict) -> str:
    """What is wrong with the solver's answer at `budget` (empty: nothing), counted."""
    try:
        plan = solve(problem, budget, Strategy.OPTIMAL, options)
    except BudgetError as error:
        counts["refusals"] += 1
        counts["proven"] += error.proven
        if budget >= low:
            return f"refused a budget the least peak {low:,} meets"
        if error.proven and error.smallest != low:
            return f"named {error.smallest:,} as the proven least, which is {low:,}"
        return ""
    counts["plans"] += 1
    if budget < low:
        return f"a plan below the least peak {low:,}"
    if plan.bound > optimum * (1 + 1e-12) + 1e-15:
        return f"bound {plan.bound:.6g} above the optimum {optimum:.6g}"
    if plan.status is Status.OPTIMAL:
        counts["optimal"] += 1
        if plan.cost > optimum * (1 + 2 * OPTIMAL_TOLERANCE) + 1e-15:
            return f"OPTIMAL at {plan.cost:.6g} above the optimum {optimum:.6g}"
    return ""


if __name__ == "__main__":
    main()
