"""Plan Llama 3 70B's shape for one rank of 64 under ZeRO-3 (FSDP2), bf16-mixed AdamW,
sequence 4096, batch 1, an 80 GB budget, on meta tensors; print the report and check that its
memory terms add up to the total.

Run: python benchmarks/llama70b.py [--layers 80] [--time-limit 120]
(80 layers: about 4 minutes of capture on two cores, then the solve.)
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import replace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "examples"))

import torch  # noqa: E402

import remat  # noqa: E402
from llama import LLAMA_70B, llama  # noqa: E402
from remat.planner.job.budget import format_size  # noqa: E402
from remat.planner.job.training import Training  # noqa: E402
from remat.solvers import SolverOptions  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=LLAMA_70B.layers)
    parser.add_argument("--budget", default="80GB")
    parser.add_argument("--time-limit", type=float, default=120.0)
    args = parser.parse_args(argv)
    start = time.perf_counter()
    model, inputs = llama(replace(LLAMA_70B, layers=args.layers), batch=1, device="meta",
                          dtype=torch.bfloat16)
    training = Training(precision="bf16-mixed", optimizer="adamw", data_parallel=64,
                        zero_stage=3)
    plan = remat.optimize(model, args.budget, example_inputs=inputs, training=training,
                          solver_options=SolverOptions(time_limit=args.time_limit))
    print(plan.report().render())
    memory = plan.memory
    added = sum(size for _, size, counted, _ in memory.rows() if counted)
    print(f"\nterms added: {added:,} bytes; total {memory.total:,}; budget {memory.budget:,}; "
          f"fits: {memory.fits}; {time.perf_counter() - start:.0f} s in all")
    print(f"activation peak {format_size(memory.activation_peak)} = simulated peak "
          f"{format_size(memory.simulated_peak)} less the gradient shards "
          f"{format_size(memory.graph_gradients)}")
    return 0 if added == memory.total and memory.fits else 1


if __name__ == "__main__":
    sys.exit(main())
