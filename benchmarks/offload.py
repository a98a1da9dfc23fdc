"""Recompute only against offload + recompute on the 7B and 70B Llama shapes, at
activation budgets where offload pays: predicted step time and activation peak.

    PYTHONPATH=$PWD python benchmarks/offload.py                       # 7b and 70b, 60 s a solve
    PYTHONPATH=$PWD python benchmarks/offload.py --models 7b --fractions 0.4 --time-limit 30

Each model is `examples/llama.py`'s 7B or 70B shape (`LLAMA_7B`, `LLAMA_70B`: bf16, sequence
4096) as benchmarks/scale.py plans them (`prepared_problem`: the ZeRO configurations of one
rank, meta tensors, three blocks traced and the middle one replicated), captured and profiled
once for `--target` (op times: its roofline). Budgets are on the simulated peak of one rank's
step (activations and the gradient shards the graph makes): the least peak recomputation
reaches (found by the solver) plus `--fractions` of the range up to saving everything. Per budget,
two solves of `remat.solvers.solve` with the same time limit:
- **recompute only**: the problem without a host link (the exact solver, `model="auto"`);
- **offload + recompute**: the same problem with the target's host link (`Device.host_link`,
  each way) and `--host-memory` of host memory: the single model's plan, then the offload
  search (`remat.solvers.cpsat.offload_search`; the rich CP-SAT model is not built at this size).
Columns: the recompute time, the transfers' time both ways and how much of it the compute hides
(`remat.solvers.timeline.overlap`), the predicted step time (the ops' roofline times plus
recomputations plus what the step waits for its transfers), the simulated activation peak, the bytes
kept in host memory, the status and the solve's wall time. Times are predictions for the target, not
measurements (benchmarks/gpu_check.py measures an overlapped offload on a GPU).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "examples"))

GiB = 2**30


def prepared_problem(name: str, target: str):
    """The model's step as benchmarks/scale.py plans it: 7B at micro-batch 2 on 8 ranks under
    ZeRO-2, 70B at micro-batch 1 on 64 ranks under ZeRO-3 (FSDP2's collectives in the step),
    bf16-mixed AdamW, sequence 4096, on meta tensors."""
    import torch
    from llama import LLAMA_7B, LLAMA_70B, llama

    from remat.planner.plans.prepare import prepare
    from remat.planner.job.training import Training

    if name == "7b":
        config, batch = LLAMA_7B, 2
        training = Training(precision="bf16-mixed", optimizer="adamw", data_parallel=8,
                            zero_stage=2)
    else:
        config, batch = LLAMA_70B, 1
        training = Training(precision="bf16-mixed", optimizer="adamw", data_parallel=64,
                            zero_stage=3)
    model, inputs = llama(config, batch=batch, device="meta", dtype=torch.bfloat16)
    began = time.perf_counter()
    problem = prepare(model, inputs, training=training, target=target).problem
    return problem, time.perf_counter() - began


def row(label: str, problem, schedule, seconds: float) -> list[str]:
    transfer, exposed = schedule.transfer_time, schedule.exposed_time
    recompute = schedule.cost - exposed
    hidden = f"{(transfer - exposed) / transfer:.1%}" if transfer else "-"
    held = sum(problem.ops[v].size for v in schedule.offload_at)
    return [label, f"{recompute * 1e3:.1f}", f"{transfer * 1e3:.1f}", hidden,
            f"{exposed * 1e3:.2f}", f"{(problem.total_cost + schedule.cost) * 1e3:.1f}",
            f"{schedule.peak / GiB:.2f}", f"{held / GiB:.2f}" if held else "-",
            schedule.status.value, f"{seconds:.0f}"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["7b", "70b"], choices=["7b", "70b"])
    parser.add_argument("--fractions", nargs="+", type=float, default=[0.5, 0.25, 0.1],
                        help="budgets: the least peak plus these shares of the range up to "
                             "saving everything")
    parser.add_argument("--target", default="h100")
    parser.add_argument("--host-memory", default=None, help="e.g. 64GB (default: unbounded)")
    parser.add_argument("--time-limit", type=float, default=60.0)
    args = parser.parse_args(argv)

    from tabulate import tabulate

    from remat.errors import BudgetError, SolverError
    from remat.fx_passes.measuring.devices import device
    from remat.planner.job.budget import parse_size
    from remat.solvers import SolverOptions, make_schedule, solve

    link = device(args.target).host_link
    host = None if args.host_memory is None else parse_size(args.host_memory)
    options = SolverOptions(time_limit=args.time_limit)
    for name in args.models:
        problem, prepare_seconds = prepared_problem(name, args.target)
        linked = dataclasses.replace(problem, host_bandwidth=link, host_capacity=host)
        save_all = make_schedule(problem, [])
        try:  # the least peak recomputation reaches (the parameters' gradients, outputs of
            # the graph, are in every peak): budgets are fractions of the range above it
            solve(problem, 0, "optimal", options)
        except BudgetError as e:
            least = e.smallest
        print(f"\n# {name}: {len(problem):,} ops; captured and profiled for {args.target} in "
              f"{prepare_seconds:.0f} s; simulated peak {save_all.peak / GiB:.2f} GiB saving "
              f"everything, {least / GiB:.2f} GiB at least (recomputation); step "
              f"{problem.total_cost * 1e3:.1f} ms; host link {link / 1e9:.0f} GB/s "
              f"each way, host memory {args.host_memory or 'unbounded'}", flush=True)
        rows = []
        for fraction in args.fractions:
            budget = least + int(fraction * (save_all.peak - least))
            for label, p in (("recompute only", problem), ("offload + recompute", linked)):
                began = time.perf_counter()
                try:
                    schedule = solve(p, budget, "optimal", options)
                except (BudgetError, SolverError) as e:
                    rows.append([f"{fraction:.0%}", label, type(e).__name__, *["-"] * 9])
                    continue
                rows.append([f"{fraction:.0%} ({budget / GiB:.1f} GiB)",
                             *row(label, p, schedule, time.perf_counter() - began)])
                print(f"# {name} {fraction:.0%} {label}: done", flush=True)
        print(tabulate(rows, headers=["budget", "plan", "recompute ms", "transfers ms",
                                      "hidden", "exposed ms", "step ms", "peak GiB",
                                      "host GiB", "status", "solve s"],
                       disable_numparse=True), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
