"""What applying a plan costs and how well the simulator predicts it, on the CPU.

For each test model and a few schedules: the simulated activation peak against the live bytes
measured inside the compiled graphs (remat's storage tracker), the recompute FLOPs measured
inside the graphs (FlopCounterMode formulas: the planned step's total minus the save-all step's)
against the plan's, and the CPU step time against eager PyTorch (the fastest of `--repeat` steps each, eager timed next to
every plan; op-by-op graphs, so this is the cost of recomputation and of running the graphs
without Inductor, not an Inductor speed).

    python benchmarks/apply_overhead.py [--models gpt mlp ...] [--repeat 5] [--json out.json]
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tabulate import tabulate  # noqa: E402

from remat.errors import BudgetError, RematError  # noqa: E402
from remat.fx_passes.tracing.capture import capture, default_loss  # noqa: E402
from remat.fx_passes.lowering.lower import lower  # noqa: E402
from remat.fx_passes.compiled.measure_step import measure_step, time_step  # noqa: E402
from remat.fx_passes.compiled.planned import planned_module  # noqa: E402
from remat.solvers import SolverOptions, solve  # noqa: E402
from remat.solvers.core.schedule import drop_unneeded, recomputable  # noqa: E402
from remat.solvers.timeline.evaluate import make_schedule
from remat.solvers.timeline.simulate import simulate  # noqa: E402
from tests import models  # noqa: E402

MODELS = ["gpt", "transformer_encoder", "resnet", "unet", "mlp", "gpt2_hf"]


def schedules(problem):
    """(label, schedule) pairs: save all, the exact solver at 80 % and 60 % of the save-all
    peak (or the smallest budget it proves), and recomputing everything recomputable."""
    base = make_schedule(problem, ())
    full = simulate(problem, base).peak
    everything = make_schedule(problem, drop_unneeded(problem, recomputable(problem)))
    yield "save all", base, None
    seen = {frozenset()}
    for fraction in (0.8, 0.6):
        budget = int(full * fraction)
        options = SolverOptions(time_limit=10, workers=2, hint=everything)
        try:
            label, schedule = f"optimal {fraction:.0%}", solve(problem, budget, "optimal", options)
        except BudgetError as e:
            if e.smallest is None or e.smallest >= full:
                continue
            label, schedule, budget = ("optimal min", solve(problem, e.smallest, "optimal",
                                                            options), e.smallest)
        if schedule.recomputed not in seen:
            seen.add(schedule.recomputed)
            yield label, schedule, budget
    yield "recompute all", everything, None


def eager_time(model, inputs, repeat):
    def step():
        model.zero_grad(set_to_none=True)
        default_loss(model(*inputs)).backward()
    return time_step(step, repeat=repeat)


def planned_time(module, inputs, repeat):
    def step():
        module.zero_grad(set_to_none=True)
        module(*inputs).backward()
    return time_step(step, repeat=repeat)


def run_model(name, repeat):
    model, inputs = getattr(models, name)()
    problem = lower(capture(model, inputs))
    eager_model = copy.deepcopy(model)
    rows, base_flops = [], None
    for label, schedule, budget in schedules(problem):
        predicted = simulate(problem, schedule).peak
        module = planned_module(copy.deepcopy(model), problem, schedule)
        torch.manual_seed(0)
        measured = measure_step(module, inputs)
        if base_flops is None:
            base_flops = measured.flops
        # Eager is timed next to each plan: the machine's load drifts between models.
        eager = eager_time(eager_model, inputs, repeat)
        step = planned_time(module, inputs, repeat)
        rows.append({
            "model": name, "schedule": label, "budget": budget,
            "recomputed": len(schedule.recomputed), "saved": len(schedule.saved),
            "predicted_peak": predicted, "measured_peak": measured.peak,
            "peak_error": (measured.peak - predicted) / predicted if predicted else 0.0,
            "plan_recompute_flops": schedule_flops(problem, schedule),
            "measured_recompute_flops": measured.flops - base_flops,
            "step_s": step, "eager_s": eager,
        })
        del module
    return rows


def schedule_flops(problem, schedule):
    return schedule.recompute_flops


def table(rows):
    def mib(b):
        return f"{b / 2**20:.3f}"
    body = [[r["model"], r["schedule"], mib(r["budget"]) if r["budget"] else "-",
             r["recomputed"], mib(r["predicted_peak"]), mib(r["measured_peak"]),
             f"{r['peak_error']:+.2%}", f"{r['plan_recompute_flops'] / 1e6:.2f}",
             f"{r['measured_recompute_flops'] / 1e6:.2f}",
             f"{r['step_s'] * 1e3:.1f}", f"{r['eager_s'] * 1e3:.1f}",
             f"{r['step_s'] / r['eager_s']:.2f}x"] for r in rows]
    headers = ["model", "schedule", "budget MiB", "recomp ops", "sim peak MiB",
               "meas peak MiB", "err", "plan rMFLOP", "meas rMFLOP", "step ms", "eager ms",
               "vs eager"]
    return tabulate(body, headers=headers, disable_numparse=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=MODELS)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json")
    parser.add_argument("--threads", type=int, default=1,
                        help="intra-op threads; one keeps timings steady on a shared CPU")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = []
    for name in args.models:
        start = time.perf_counter()
        try:
            rows.extend(run_model(name, args.repeat))
        except RematError as e:
            print(f"{name}: {e}", file=sys.stderr)
        print(f"# {name}: {time.perf_counter() - start:.0f} s", file=sys.stderr)
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
