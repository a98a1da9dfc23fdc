"""Where least_vs_per_block.py's eager rows read above per-block checkpointing, and why.

    python benchmarks/_least_causes.py [--models resnet,resnet_cnn,unet_bn,qwen3_moe]

Per model, the eager plan at its least budget (BudgetError's `smallest` at budget 1):
- the eager timeline's peak as planned, and with the ops remat may not recompute because they
  write state (`Reason.MUTATION`: BatchNorm's ``num_batches_tracked + 1``, 8 B each) sized 0
  B, which eager PyTorch does in place (``add_``) and never holds;
- the allocator's activation peak (hf_zoo's `activation_peak`) of the plan as applied, of the
  same blocks with nothing cached (remat's own per-block checkpointing, `with_cache(policy,
  frozenset())`), and of Hugging Face's ``gradient_checkpointing_enable`` where the model has
  it; and the op at which each of the first two peaks (the allocator's events, torch.profiler).
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.least_vs_per_block import _optimize, make, step_of  # noqa: E402
from examples.hf_zoo import activation_peak, zero  # noqa: E402
from remat.errors import BudgetError  # noqa: E402
from remat.fx_passes.eager.apply import apply_eager  # noqa: E402
from remat.fx_passes.eager.block_policy import with_cache  # noqa: E402
from remat.solvers import SolverOptions  # noqa: E402
from remat.solvers.core.problem import Kind, Reason, recompute_blocker  # noqa: E402
from remat.solvers.timeline.eager import eager_schedule  # noqa: E402


def peak_op(step) -> str:
    """The op during which the allocator's running sum peaks in `step()`."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events, stack = [], [(e, "") for e in prof.profiler.kineto_results.experimental_event_tree()]
    while stack:
        event, parent = stack.pop()
        fields = event.extra_fields
        allocation = type(fields).__name__ == "_ExtraFields_Allocation"
        stack.extend((c, parent if allocation else event.name) for c in event.children)
        if allocation and fields.device.type == "cpu":
            events.append((event.start_time_ns, fields.ptr, fields.alloc_size, parent))
    events.sort(key=lambda e: e[0])
    live, now, best, where = {}, 0, -1, ""
    for _, ptr, size, parent in events:
        if size > 0:
            live[ptr] = size
            now += size
        elif ptr in live:
            now -= live.pop(ptr)
        if now > best:
            best, where = now, parent
    return where


def measured(model, case) -> tuple[int, str]:
    step = step_of(model, case)
    for _ in range(2):
        step()
    peak = activation_peak(step, model)
    zero(model)
    return peak, peak_op(step)


def causes(name: str, options: SolverOptions) -> None:
    case = make(name)
    try:
        _optimize(copy.deepcopy(case.model), case, "eager", 1, options)
    except BudgetError as e:
        least = e.smallest
    model = copy.deepcopy(case.model)
    plan = _optimize(model, case, "eager", least, options)
    problem, blocks = plan.eager_problem, plan.structure
    grads, cached = plan.prepared.graph_gradients, plan.schedule.info["cached"]
    writes = [v for ops in blocks.ops.values() for v in ops
              if recompute_blocker(problem, v) is Reason.MUTATION
              and problem.ops[v].kind is not Kind.VIEW]
    ops = list(problem.ops)
    for v in writes:
        ops[v] = dataclasses.replace(ops[v], size=0)
    unwritten = dataclasses.replace(problem, ops=tuple(ops))
    def timeline(p, c) -> str:
        return f"{eager_schedule(p, blocks, c).peak - grads:,}"

    print(f"{name}: least {least:,}; eager timeline {timeline(problem, cached)}, with the "
          f"{len(writes)} state writes ({sum(problem.ops[v].size for v in writes)} B) at 0 B "
          f"{timeline(unwritten, cached)}; nothing cached {timeline(problem, ())}")
    none = copy.deepcopy(case.model)
    apply_eager(none, {p: dataclasses.replace(with_cache(pol, frozenset()), training=True)
                       for p, pol in plan.block_policies.items()})
    for label, m in (("the plan", plan.apply(model)), ("nothing cached", none)):
        peak, op = measured(m, case)
        print(f"  allocator, {label}: {peak:,} (peaks in {op})")
    if case.hf and case.model.supports_gradient_checkpointing:
        hf = copy.deepcopy(case.model)
        hf.gradient_checkpointing_enable({"use_reentrant": False})
        print(f"  allocator, HF gradient_checkpointing_enable: {measured(hf, case)[0]:,}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="resnet,resnet_cnn,unet_bn,qwen3_moe")
    parser.add_argument("--time-limit", type=float, default=10.0)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    for name in args.models.split(","):
        causes(name, SolverOptions(time_limit=args.time_limit))


if __name__ == "__main__":
    main()
