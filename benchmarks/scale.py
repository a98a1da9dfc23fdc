"""Planning time and memory as Llama-style models grow: a column per phase, a row per model.

    python benchmarks/scale.py                       # the solver's defaults (limits by size)
    python benchmarks/scale.py --models 7b 70b --load 2 # beside 2 busy processes
    python benchmarks/scale.py --models 7b 70b --time-limit 30 --relative-gap 0
    python benchmarks/scale.py --models 8L --no-replicate      # the full trace, for comparison

Models (examples/llama.py, meta tensors, bf16, sequence 4096, micro-batch 1): ``8L`` .. ``80L``
are the 7B's width (hidden 4096, 32 heads, MLP 11008) with 8, 16, 32, 64 and 80 layers, bf16-mixed
AdamW, each with an activation budget of ``--fraction`` (60 %) of its save-all activation peak,
so that every depth gets a plan to simulate and report. ``7b`` is `remat demo`'s 7B (32 layers,
micro-batch 2, 8 data-parallel ranks, ZeRO-2, a budget of 80 GB for the whole step). ``70b`` is
Llama-2-70B's shape (80 layers, hidden 8192, 64 heads, 8 key/value heads, MLP 28672) on 64 ranks,
ZeRO-3, 80 GB each.

Every model runs in a fresh process, so that its peak RSS (``ru_maxrss``, with torch imported)
is its own; the phases are timed there:
- capture: the joint graph (three blocks traced and the middle one replicated, unless
  ``--no-replicate``); profile; lower: `remat.planner.optimize.prepare`'s own phases;
- solve: `plan_prepared` with ``--solver``, ``--time-limit`` and ``--relative-gap`` (the solver
  stops once its plan is proven that close; a BudgetError is a row with its status, and the
  phases after it are "-");
- simulate: `remat.solvers.timeline.simulate` of the plan (the simulator is the judge of
  every plan);
- report: the report (its baselines solved) rendered.
"limit" is the one chosen for the problem's size (the solver's own, as in `remat.optimize`: the
capture before it does not count); "solve/limit" the solve's wall seconds and its limit.
"optimize" is the wall seconds from the capture's start to the plan, what `remat.optimize` takes
(the layer sweep's save-all simulation for its budget included). "total" is the sum of the
phases; in brackets and in "cpu", the process's CPU seconds (CP-SAT's workers add up); "import"
the seconds to import torch and remat before them. Timings are wall seconds and depend on the
load of the machine: the header prints the load average.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PHASES = ("capture", "profile", "lower", "solve", "simulate", "report")
MODELS = ("8L", "16L", "32L", "64L", "80L", "7b", "70b")


def _configure(name: str):
    """(LlamaConfig, Training, whole-step budget or None, micro-batch) of a model name."""
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    from dataclasses import replace

    from llama import LLAMA_7B, LLAMA_70B

    from remat.planner.job.training import Training

    if name == "70b":
        return LLAMA_70B, Training(precision="bf16-mixed", optimizer="adamw", data_parallel=64,
                                   zero_stage=3), "80GB", 1
    if name == "7b":
        return LLAMA_7B, Training(precision="bf16-mixed", optimizer="adamw", data_parallel=8,
                                  zero_stage=2), "80GB", 2
    training = Training(precision="bf16-mixed", optimizer="adamw")
    return replace(LLAMA_7B, layers=int(name.rstrip("L"))), training, None, 1


def measure(name: str, *, solver: str, time_limit: float, relative_gap: float, replicate: bool,
            fraction: float, prepare_only: bool = False) -> dict:
    """One model's row, in this process."""
    import resource

    start = time.perf_counter()
    import torch

    from remat.errors import BudgetError
    from remat.planner.job.budget import format_size, parse_size
    from remat.planner.plans.plan import plan_prepared
    from remat.planner.plans.prepare import prepare
    from remat.solvers import SolverOptions, make_schedule, simulate

    config, training, budget, batch = _configure(name)
    from llama import llama

    row: dict = {"model": name, "layers": config.layers, "hidden": config.hidden,
                 "import": time.perf_counter() - start}

    def cpu() -> float:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime

    cpu_start = cpu()

    def rss() -> float:  # peak so far, GiB (Linux reports KiB)
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20

    def done(phase: str, seconds: float) -> None:
        row[phase] = seconds
        row["rss"] = rss()
        row[f"{phase} cpu"] = cpu() - cpu_start - sum(row.get(f"{p} cpu", 0.0) for p in PHASES)
        row["cpu"] = cpu() - cpu_start

    model, inputs = llama(config, batch=batch, device="meta", dtype=torch.bfloat16)
    # What `remat.optimize` does: a time limit left to the problem's size is the solver's own.
    options = SolverOptions(time_limit=time_limit, relative_gap=relative_gap)
    call_start = time.perf_counter()
    prepared = prepare(model, inputs, training=training, target="h100", replicate=replicate,
                       progress=done)
    row["ops"] = len(prepared.problem)
    row["replicated"] = hasattr(prepared.captured, "blocks")
    if prepare_only:
        return row
    sized = options.by_size(len(prepared.problem))
    row["limit"] = f"{sized.time_limit:g} s, {sized.relative_gap:.0%}"
    activations = None
    if budget is None:  # a share of the save-all peak (the budget's choice, not timed)
        save_all = simulate(prepared.problem, make_schedule(prepared.problem, [])).peak
        activations = int(fraction * save_all)
        row["budget"] = f"{fraction:.0%} act."
    else:
        row["budget"] = budget
        budget = parse_size(budget)
    mark = time.perf_counter()
    try:
        plan = plan_prepared(model, prepared, budget=budget, activation_budget=activations,
                             target="h100", solver=solver, solver_options=options)
    except BudgetError as e:
        done("solve", time.perf_counter() - mark)
        row["status"] = "BudgetError"
        row["note"] = str(e).splitlines()[0][:90]
        return row
    done("solve", time.perf_counter() - mark)
    row["optimize"] = time.perf_counter() - call_start
    row["solve limit"] = plan.schedule.info.get("time_limit")
    row["status"] = plan.status.value
    repeatable = plan.schedule.info.get("deterministic")
    row["repeatable"] = "-" if repeatable is None else "yes" if repeatable is True else "cut"
    row["gap"] = plan.gap
    row["peak"] = format_size(plan.peak)
    mark = time.perf_counter()
    simulated = simulate(prepared.problem, plan.schedule)
    done("simulate", time.perf_counter() - mark)
    if simulated.peak != plan.schedule.peak:
        row["note"] = f"simulated peak {simulated.peak} != claimed {plan.schedule.peak}"
    mark = time.perf_counter()
    plan.report().render()
    done("report", time.perf_counter() - mark)
    return row


def _run_child(name: str, args) -> dict:
    command = [sys.executable, __file__, "--child", name, "--solver", args.solver,
               "--fraction", str(args.fraction)]
    if args.time_limit is not None:
        command += ["--time-limit", str(args.time_limit)]
    if args.relative_gap is not None:
        command += ["--relative-gap", str(args.relative_gap)]
    command += ["--no-replicate"] * args.no_replicate + ["--prepare-only"] * args.prepare_only
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {"model": name, "status": f"failed: {tail[:80]}"}
    return json.loads(lines[-1])


def table(rows: list[dict]) -> str:
    from tabulate import tabulate

    def cell(row, key, fmt):
        value = row.get(key)
        return "-" if value is None else fmt(value)

    body = []
    for r in rows:
        total = sum(r.get(p) or 0.0 for p in PHASES) if "capture" in r else None
        limit = r.get("limit", "-")
        solve, solve_limit = r.get("solve"), r.get("solve limit")
        wall = "-" if solve is None else f"{solve:.1f}/" + (
            limit.split()[0] if solve_limit is None else f"{solve_limit:.1f}")
        body.append([r["model"], cell(r, "layers", str), cell(r, "ops", lambda v: f"{v:,}"),
                     r.get("budget", "-"), limit, wall,
                     *(cell(r, p, lambda v, p=p: f"{v:.2f} ({r[p + ' cpu']:.2f})")
                       for p in PHASES),
                     cell({"t": total}, "t", lambda v: f"{v:.1f}"),
                     cell(r, "optimize", lambda v: f"{v:.1f}"),
                     cell(r, "cpu", lambda v: f"{v:.1f}"),
                     cell(r, "import", lambda v: f"{v:.1f}"),
                     cell(r, "rss", lambda v: f"{v:.2f}"), r.get("status", "-"),
                     cell(r, "gap", lambda v: f"{v:.1%}"), r.get("repeatable", "-"),
                     r.get("peak", "-"), r.get("note", "")])
    headers = ["model", "layers", "ops", "budget", "limit", "solve/limit",
               *(f"{p} s (cpu)" for p in PHASES), "total s", "optimize s", "cpu s", "import s",
               "RSS GiB", "status", "gap", "repeatable", "peak", "note"]
    return tabulate(body, headers=headers, disable_numparse=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--solver", default="optimal", help="a remat.solvers.Strategy value")
    parser.add_argument("--time-limit", type=float, default=None,
                        help="seconds the solver may take per model (default: the solver's, "
                             "chosen by problem size)")
    parser.add_argument("--relative-gap", type=float, default=None,
                        help="stop once the plan is proven within this share of the optimum "
                             "(default: the solver's, by problem size)")
    parser.add_argument("--load", type=int, default=0,
                        help="busy processes (spin loops) to run beside the models")
    parser.add_argument("--no-replicate", action="store_true",
                        help="trace every block (the capture before replication)")
    parser.add_argument("--fraction", type=float, default=0.6,
                        help="activation budget of the layer sweep, of the save-all peak")
    parser.add_argument("--prepare-only", action="store_true",
                        help="stop after capture, profile and lower")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(measure(args.child, solver=args.solver, time_limit=args.time_limit,
                                 relative_gap=args.relative_gap,
                                 replicate=not args.no_replicate, fraction=args.fraction,
                                 prepare_only=args.prepare_only)))
        return 0
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _load import busy

    rows = []
    with busy(args.load):
        for name in args.models:
            rows.append(_run_child(name, args))
            print(f"{name}: done", file=sys.stderr, flush=True)
        load = os.getloadavg()[0]
    limits = ("the solver's default limits (by problem size)" if args.time_limit is None
              and args.relative_gap is None else
              f"time limit {args.time_limit}, relative gap {args.relative_gap}")
    print(f"solver {args.solver}, {limits}, "
          f"{'full trace' if args.no_replicate else 'replicated capture'}, "
          f"{os.cpu_count()} CPUs, {args.load} busy processes beside, load average {load:.1f}")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
