"""remat against its peers on the CPU: activation peak and recompute FLOPs, per model and budget.

    python benchmarks/peers.py [--quick] [--models gpt2-6,mlp] [--time-limit S] [--out DIR]

The defaults are sized to end in about ten minutes on two CPU cores: the three models without
attention (mlp, unet, resnet-bn; `--models` adds llama, gpt2-6 and gpt2-12, several minutes
each), 5 s of remat's exact solver per budget (SolverOptions sizes its other limits by the
problem), six evenly spaced budgets plus the baselines' peaks, torch's fractions 0, 0.25, 0.5,
0.75, 1 with one halving toward each budget's, one timed step per configuration and 10 s per
proven bound.

Strategies: remat's exact plan at each budget; torch.compile's min-cut partitioner under
torch._functorch.config.activation_memory_budget (the largest fraction whose measured peak
fits each budget; the fraction bounds saved bytes, not the peak); torch.utils.checkpoint around
every block; Chen's sqrt(n) segments (checkpoint_sequential-style over the blocks, or remat's
chen_sqrt schedule where the blocks are not a chain); no checkpointing.

Every strategy is measured the same way: the CPU allocator's peak of the step (torch.profiler's
memory events; kernel scratch included, such as a convolution backward's workspace, which remat
plans and a storage tracker would leave out; for compiled strategies their graph calls are
checked), the parameters' gradients included: remat's activation_budget leaves them out, so it
is given each budget less the gradients, and its predicted peak has them added back.
FLOPs by FlopCounterMode's formulas (recompute = the step's minus no-checkpointing's),
gradients against eager's with the same seed, and CPU step time. Compiled strategies run their
graphs op by op (boxed_nop): they are compared by what they save and recompute, not by kernels.

Each model runs in its own process so that dynamo's caches and memory do not leak between them.
The tables and the verdicts are computed from the measurements; the plots and each model's
JSON go to --out (--report-only renders that JSON again). Beside the measurements, each model
gets bounds that no schedule of remat's execution model can beat (remat.solvers.relaxation.bound,
proven independently of remat's search): the least activation peak, and the least recompute FLOPs at
per-block checkpointing's peak. A check that remat misses and that bound proves no schedule can
meet is marked UNATTAINABLE. The exit status is 1 when a verdict fails (FAIL; UNATTAINABLE is
reported, not counted) or a model's process crashed.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]

from _peers_models import MODELS  # noqa: E402
from _peers_report import render  # noqa: E402

# The models of a plain run: the three that end in minutes on two cores (see the docstring).
DEFAULT_MODELS = ("mlp", "unet", "resnet-bn")


def run_model(name: str, *, quick: bool, out: str, timeout: float,
              time_limit: float | None) -> dict:
    path = os.path.join(out, f"peers_{name}.json")
    command = [sys.executable, os.path.join(HERE, "_peers_worker.py"), name, path]
    if quick:
        command.append("--quick")
    if time_limit is not None:
        command += ["--time-limit", str(time_limit)]
    print(f"-- {name}: {' '.join(command)}", flush=True)
    try:
        done = subprocess.run(command, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"model": name, "quick": quick, "crash": f"timed out after {timeout:.0f} s"}
    if not os.path.exists(path):
        return {"model": name, "quick": quick, "crash": f"exit status {done.returncode}, no output"}
    with open(path) as f:
        return json.load(f)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS),
                        help=f"comma-separated, from: {', '.join(MODELS)} (default: "
                             f"{','.join(DEFAULT_MODELS)})")
    parser.add_argument("--quick", action="store_true",
                        help="tiny configurations, fewer fractions and timed steps: a smoke run")
    parser.add_argument("--out", default=os.path.join(HERE, "out"))
    parser.add_argument("--timeout", type=float, default=3600.0,
                        help="seconds per model before its process is stopped")
    parser.add_argument("--time-limit", type=float,
                        help="seconds of remat's exact solver per budget (default: 5, "
                             "3 with --quick)")
    parser.add_argument("--report-only", action="store_true",
                        help="render the JSON already in --out without running anything")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        parser.error(f"unknown models {unknown}; choose from {', '.join(MODELS)}")
    os.makedirs(args.out, exist_ok=True)

    started = time.perf_counter()
    failed = False
    for name in names:
        if args.report_only:
            with open(os.path.join(args.out, f"peers_{name}.json")) as f:
                result = json.load(f)
        else:
            result = run_model(name, quick=args.quick, out=args.out, timeout=args.timeout,
                               time_limit=args.time_limit)
        text = render(result, args.out)
        failed |= "[FAIL]" in text or "crash" in result
        print(text, flush=True)
        print(flush=True)
    print(f"{len(names)} models in {time.perf_counter() - started:.0f} s", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
