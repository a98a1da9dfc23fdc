"""Exact eager plans against the heuristic they replace and the compiled plans: the least
activation budget each reaches, and the eager planner's status, gap and time at time_limit=10.

    PYTHONPATH=$PWD python benchmarks/eager_exact.py [--models gpt,t5] [--time-limit 10]

Models: the project's test models (tests/models.py), the tiny Llama (examples/llama.py) and
Hugging Face GPT-2, ViT, BERT and T5 at examples/hf_zoo.py's tiny configurations (CPU, fp32,
dropout on). Per model, in activations (the simulated peak less the graph's gradients, what
`activation_budget` bounds):
- eager least: the least eager peak of any per-block policy (`least_eager_peak`, CP-SAT over
  the eager timeline), "proven" where the search proved it the least;
- heuristic least: the least budget at which the old eager planner (the compiled plan at that
  budget and two baselines as seeds, `plan_eager` repairing them) finds a policy, by bisection
  between the eager least and the peak of caching nothing (to 1/256 of the range; the
  heuristic need not be monotone, so this is where the bisection lands);
- compiled least: the least peak of the compiled plan (`solve(..., budget=0)`'s BudgetError),
  on the joint graph's bytes, "proven" where the solver proved it; and the same on the eager
  problem's bytes (a CPU dropout's noise tensor is as large as its input, ...), which leaves
  the difference of the two timelines alone;
- the eager plan (`optimize(..., execution="eager")`'s planner, time_limit 10) at the eager
  least and halfway to caching everything: status, gap and seconds of the solve (the compiled
  seed, the heuristic, the exact search), and the old planner's seconds at the halfway budget
  (its compiled seed, then the heuristic without a deadline), and the recompute time (µs on
  the target, predicted) of both plans there.
"""
from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from remat.errors import BudgetError, RematError, SolverError  # noqa: E402
from remat.planner.job.budget import format_size  # noqa: E402
from remat.planner.plans.eager_plan import eager_structure, plan_eager_mode  # noqa: E402
from remat.planner.plans.prepare import prepare  # noqa: E402
from remat.solvers import SolverOptions, Strategy, solve  # noqa: E402
from remat.solvers.eager.search import least_eager_peak  # noqa: E402
from remat.solvers.timeline.eager import eager_schedule  # noqa: E402
from remat.solvers.eager.heuristic import plan_eager  # noqa: E402

BISECTION_STEPS = 8
OLD_SEED_SECONDS = 3.0  # the compiled seed's limit inside the bisection (each step solves it)


def builders() -> dict:
    from examples import hf_zoo
    from examples.llama import tiny_llama
    from tests import models

    found = {name: (lambda f=f: (*f(), {})) for name, f in models.MODELS.items()}
    found["tiny_llama"] = lambda: (*tiny_llama(), {})
    def hugging_face(name: str):
        model, kwargs = hf_zoo.build(name)
        return model, (), kwargs

    for name in ("gpt2", "vit", "bert", "t5"):
        found[f"hf_{name}"] = lambda name=name: hugging_face(name)
    return found


def old_planner(problem, structure, allowance: int, seconds: float):
    """The eager planner before the exact search: the compiled plan at the budget and two
    baselines as seeds, repaired and improved by `plan_eager` (no deadline)."""
    seeds = [frozenset(), structure.cacheable]
    try:
        compiled = solve(problem, allowance, Strategy.OPTIMAL,
                         SolverOptions(time_limit=seconds, model="single"))
        seeds.insert(0, compiled.saved)
    except (BudgetError, SolverError):
        pass
    return plan_eager(problem, structure, allowance, seeds)


def heuristic_least(problem, structure, low: int, high: int) -> int:
    """The least allowance the old planner meets, by bisection in [low, high]."""
    try:
        old_planner(problem, structure, high, OLD_SEED_SECONDS)
    except BudgetError:
        return -1  # not even at the peak of caching nothing
    try:
        old_planner(problem, structure, low, OLD_SEED_SECONDS)
        return low
    except BudgetError:
        pass
    step = max(1, (high - low) // 2 ** BISECTION_STEPS)
    while high - low > step:
        mid = (low + high) // 2
        try:
            old_planner(problem, structure, mid, OLD_SEED_SECONDS)
            high = mid
        except BudgetError:
            low = mid
    return high


def compiled_least(problem, seconds: float) -> tuple[int, bool]:
    try:
        solve(problem, 0, Strategy.OPTIMAL, SolverOptions(time_limit=seconds))
    except BudgetError as e:
        return e.smallest, "(proven); recomputation cannot go lower" in str(e)
    return 0, True


def measure(name: str, build, seconds: float) -> list:
    model, args, kwargs = build()
    began = time.perf_counter()
    prepared = prepare(model, args, example_kwargs=kwargs or None)
    capture = time.perf_counter() - began
    grads = prepared.graph_gradients
    size = lambda peak: format_size(peak - grads)  # noqa: E731  (activations)
    try:
        problem, structure, _, _ = eager_structure(model, prepared, None, args, kwargs)
    except RematError as e:
        return [name, len(prepared.problem), "", f"no eager plan: {str(e)[:60]}"] + [""] * 8
    options = SolverOptions(time_limit=seconds)
    least, floor = least_eager_peak(problem, structure, options)
    nothing = eager_schedule(problem, structure, ()).peak
    everything = eager_schedule(problem, structure, structure.cacheable).peak
    old = heuristic_least(problem, structure, least.peak, max(nothing, least.peak))
    row = [name, len(problem), len(structure.cacheable),
           f"{size(least.peak)}{' proven' if floor >= least.peak else ''}",
           size(old) if old >= 0 else "none fits"]
    for graph in (prepared.problem, problem):  # the joint graph's bytes, then eager's
        compiled, proven = compiled_least(graph, seconds)
        row.append(f"{size(compiled)}{' proven' if proven else ''}")
    middle = (least.peak + max(everything, least.peak)) // 2
    for allowance in (least.peak, middle):
        began, plan = time.perf_counter(), None  # the halfway plan is compared below
        try:
            plan = plan_eager_mode(model, prepared, budget=None,
                                   activation_budget=allowance - grads, target="h100",
                                   solver=Strategy.OPTIMAL, solver_options=options, blocks=None,
                                   example_inputs=args, example_kwargs=kwargs)
            s = plan.schedule
            gap = "" if s.gap is None else f", gap {100 * s.gap:.2f} %"
            row.append(f"{s.status.value}{gap}, {s.solve_time:.1f} s "
                       f"({time.perf_counter() - began:.1f} s)")
        except RematError as e:
            row.append(f"{type(e).__name__} ({time.perf_counter() - began:.1f} s)")
    began = time.perf_counter()
    try:
        cost = old_planner(problem, structure, middle, seconds).cost
        row.append(f"{time.perf_counter() - began:.1f} s")
        row.append("" if plan is None else f"{1e6 * plan.schedule.cost:.2f} vs {1e6 * cost:.2f}")
    except BudgetError:
        row += [f"BudgetError ({time.perf_counter() - began:.1f} s)", ""]
    row.append(f"{capture:.0f} s")
    print(tabulate([row], disable_numparse=True), flush=True)
    return row


HEADERS = ["model", "ops", "cacheable", "eager least", "heuristic least", "compiled least",
           "compiled, eager bytes", "eager at least", "eager halfway", "old at halfway", "halfway µs: exact vs old",
           "capture"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    known = builders()
    parser.add_argument("--models", default=",".join(known),
                        help=f"comma-separated, from {', '.join(known)}")
    parser.add_argument("--time-limit", type=float, default=10.0, help="seconds per solve")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="remat: %(message)s")
    rows = []
    for name in args.models.split(","):
        try:
            rows.append(measure(name, known[name], args.time_limit))
        except Exception as e:  # the table reports every failure with its cause
            rows.append([name, "", "", f"{type(e).__name__}: {str(e)[:80]}"] + [""] * 8)
    print("\nLeast activation budgets (simulated peak less the graph's gradients; CPU, fp32) "
          "and the eager planner at time_limit "
          f"{args.time_limit:g} s: status, gap, the solve's seconds (the planner call's)")
    print(tabulate(rows, headers=HEADERS, disable_numparse=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
