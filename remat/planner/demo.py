"""`remat demo`: no network, no optional dependencies.

1. Plans the 7B Llama-style configuration (examples/llama.py, sequence 4096, micro-batch 2) on
   meta tensors, no weight allocated, for one 80 GB H100 of eight data-parallel ranks (bf16
   mixed precision, AdamW, ZeRO-2), and prints the report.
2. Plans a small Llama-style GPT on the CPU between checkpointing every block and saving all,
   runs one real training step with the plan, and prints the predicted and the measured
   activation peak.
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from remat.errors import BudgetError
from remat.planner.budget import format_size, parse_size
from remat.planner.report import Measured
from remat.planner.training import Training
from remat.solvers import SolverOptions, Strategy

BUDGET_7B = "80GB"
TRAINING_7B = Training(precision="bf16-mixed", optimizer="adamw", data_parallel=8, zero_stage=2)
TRAINING_SMALL = Training(optimizer="adamw", reserve=0, fragmentation=0.0)


def _llama_example():
    """examples/llama.py of the repository (not part of the installed package)."""
    path = Path(__file__).resolve().parents[2] / "examples" / "llama.py"
    if not path.is_file():
        raise FileNotFoundError(f"remat demo needs the repository's {path}")
    spec = importlib.util.spec_from_file_location("remat_demo_llama", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def run_demo(*, time_limit: float = 30.0) -> int:
    import torch

    from remat.fx_passes.memory_tracker import MemoryTracker
    from remat.planner.optimize import plan_prepared, prepare

    example = _llama_example()
    options = SolverOptions(time_limit=time_limit)

    print(f"== 1. Llama 7B on meta tensors, budget {BUDGET_7B} per device ==", flush=True)
    model, inputs = example.llama(example.LLAMA_7B, batch=2, device="meta",
                                  dtype=torch.bfloat16)
    prepared = prepare(model, inputs, training=TRAINING_7B, target="h100")
    budget = parse_size(BUDGET_7B)
    try:
        plan = plan_prepared(model, prepared, budget=budget, activation_budget=None,
                             target="h100", solver=Strategy.OPTIMAL, solver_options=options)
    except BudgetError as e:
        print(f"BudgetError: {e}")
    else:
        print(plan.report().render())

    print("\n== 2. A small GPT (Llama-style) on the CPU: plan, run one step, measure ==",
          flush=True)
    model, inputs = example.llama(example.LLAMA_TINY, batch=8, device="cpu")
    prepared = prepare(model, inputs, training=TRAINING_SMALL, target="h100")
    peaks = sorted(s.peak for s in prepared.baselines.values())
    # Between checkpointing every block and saving all, in activations (the state aside).
    allowance = (peaks[0] + peaks[-1]) // 2 - prepared.graph_gradients
    plan = plan_prepared(model, prepared, budget=None, activation_budget=allowance,
                         target="h100", solver_options=options)
    tracker = MemoryTracker()
    module = plan.module
    with module.instrument(lambda phase: tracker) as calls:
        module(*inputs).backward()
    if calls.forward != 1 or calls.backward != 1:
        print(f"the planned graphs did not run as expected: {calls}")
        return 1
    measured = Measured(peak=tracker.peak, source="MemoryTracker (live storages, CPU)")
    print(plan.report(measured=measured).render())
    predicted = plan.memory.simulated_peak  # the graph's values: activations and gradients
    error = (tracker.peak - predicted) / max(predicted, 1)
    print(f"\npredicted live bytes of the step's graph: {predicted} bytes "
          f"({format_size(predicted)}); measured: {tracker.peak} bytes "
          f"({format_size(tracker.peak)}); error {100 * error:+.2f} %")
    return 0
