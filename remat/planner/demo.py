"""`remat demo`: no network, no optional dependencies.

1. Plans the 7B Llama-style configuration (examples/llama.py, sequence 4096, micro-batch 2) on
   meta tensors, no weight allocated, for one 80 GB H100 of eight data-parallel ranks (bf16
   mixed precision, AdamW, ZeRO-2), and prints the report. Three of its 32 blocks are traced
   and the middle one replicated (remat.fx_passes.tracing.replicate); a line per phase gives its time.
   Then one line for the 70B shape (Llama-2-70B: 80 layers, hidden 8192, grouped-query
   attention) on 64 ZeRO-3 ranks of 80 GB: the per-rank memory, the plan's status and gap, or
   the BudgetError that says why it does not fit.
2. Plans a small Llama-style GPT on the CPU between checkpointing every block and saving all,
   runs one real training step with the plan, and prints the predicted and the measured
   activation peak.
"""
from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path

from remat.errors import BudgetError
from remat.planner.job.budget import format_size, parse_size
from remat.planner.plans.report import Measured
from remat.planner.job.training import Training
from remat.solvers import SolverOptions, Strategy

BUDGET_7B = "80GB"
TRAINING_7B = Training(precision="bf16-mixed", optimizer="adamw", data_parallel=8, zero_stage=2)
BUDGET_70B = "80GB"
TRAINING_70B = Training(precision="bf16-mixed", optimizer="adamw", data_parallel=64,
                        zero_stage=3)
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


def run_demo(*, time_limit: float | None = None) -> int:
    import torch

    from remat.fx_passes.compiled.measure_step import measure_step
    from remat.planner.plans.plan import plan_prepared
    from remat.planner.plans.prepare import prepare

    example = _llama_example()
    # What `optimize` does with no options: the limits chosen by the problem's size (the
    # report's solver section states them), deterministic planning.
    options = SolverOptions(time_limit=time_limit)
    limit = (f"at most {time_limit:g} s a plan" if time_limit is not None else
             "its default limits, chosen by each problem's size")
    print(f"(solver: optimal, {limit}; see each report's solver section)", flush=True)

    print(f"== 1. Llama 7B on meta tensors, budget {BUDGET_7B} per device ==", flush=True)
    started = time.perf_counter()
    model, inputs = example.llama(example.LLAMA_7B, batch=2, device="meta",
                                  dtype=torch.bfloat16)
    plan = _plan_on_meta(model, inputs, TRAINING_7B, BUDGET_7B, options, "7B")
    if plan is not None:
        mark = time.perf_counter()
        text = plan.report().render()
        _progress("7B")("report", time.perf_counter() - mark)
        print(text)
    print(f"7B planned in {time.perf_counter() - started:.1f} s", flush=True)

    print(f"\n== 70B shape (80 layers, hidden 8192, GQA) on {TRAINING_70B.data_parallel} "
          f"ZeRO-3 ranks, budget {BUDGET_70B} per rank ==", flush=True)
    started = time.perf_counter()
    model, inputs = example.llama(example.LLAMA_70B, batch=1, device="meta",
                                  dtype=torch.bfloat16)
    plan = _plan_on_meta(model, inputs, TRAINING_70B, BUDGET_70B, options, "70B")
    if plan is not None:
        m = plan.memory
        gap = "-" if plan.gap is None else f"{plan.gap:.1%}"
        print(f"70B: per-rank peak {format_size(plan.peak)} of {BUDGET_70B} (state "
              f"{format_size(m.static)}, activations {format_size(m.activation_peak)}), "
              f"{plan.status.value}, gap {gap}")
    print(f"70B planned in {time.perf_counter() - started:.1f} s", flush=True)

    print("\n== 2. A small GPT (Llama-style) on the CPU: plan, run one step, measure ==",
          flush=True)
    model, inputs = example.llama(example.LLAMA_TINY, batch=8, device="cpu")
    prepared = prepare(model, inputs, training=TRAINING_SMALL, target="h100")
    peaks = sorted(s.peak for s in prepared.baselines.values())
    # Between checkpointing every block and saving all, in activations (the state aside).
    allowance = (peaks[0] + peaks[-1]) // 2 - prepared.graph_gradients
    plan = plan_prepared(model, prepared, budget=None, activation_budget=allowance,
                         target="h100", solver_options=options)
    # The allocator is the judge (kernel scratch included); measure_step runs the step once.
    step = measure_step(plan.module, inputs)
    measured = Measured(peak=step.peak, source="the CPU allocator (profiler memory events)")
    print(plan.report(measured=measured).render())
    predicted = plan.memory.simulated_peak  # the graph's values: activations and gradients
    error = (step.peak - predicted) / max(predicted, 1)
    print(f"\npredicted live bytes of the step's graph: {predicted} bytes "
          f"({format_size(predicted)}); measured by the allocator: {step.peak} bytes "
          f"({format_size(step.peak)}); error {100 * error:+.2f} %")
    return 0


def _progress(label: str):
    def done(phase: str, seconds: float) -> None:
        print(f"  {label} {phase:<9}{seconds:6.1f} s", flush=True)
    return done


def _plan_on_meta(model, inputs, training: Training, budget: str, options: SolverOptions,
                  label: str):
    """Prepare (replicated), solve and simulate with a progress line per phase; the plan, or
    None after printing the BudgetError as a line."""
    from remat.planner.plans.plan import plan_prepared
    from remat.planner.plans.prepare import prepare
    from remat.solvers import simulate

    say = _progress(label)
    prepared = prepare(model, inputs, training=training, target="h100", replicate=True,
                       progress=say)
    mark = time.perf_counter()
    try:
        plan = plan_prepared(model, prepared, budget=parse_size(budget), activation_budget=None,
                             target="h100", solver=Strategy.OPTIMAL, solver_options=options)
    except BudgetError as e:
        say("solve", time.perf_counter() - mark)
        smallest = "" if e.smallest is None else f"; the smallest that fits: " \
            f"{format_size(e.smallest)} per rank"
        print(f"{label}: BudgetError: {str(e).splitlines()[0]} (state "
              f"{format_size(prepared.state.total)} per rank{smallest})")
        return None
    say("solve", time.perf_counter() - mark)
    mark = time.perf_counter()
    simulated = simulate(prepared.problem, plan.schedule).peak
    say("simulate", time.perf_counter() - mark)
    if simulated != plan.schedule.peak:
        print(f"{label}: the simulator gives {simulated} bytes for a plan that claims "
              f"{plan.schedule.peak}")
    return plan
