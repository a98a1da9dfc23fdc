"""PyTorch's AutoSAC pipeline for FSDP2 (`torch.distributed._tools`), run as a user would run
it, for benchmarks/sharded.py. Benchmark-only: needs `pulp` and `pwlf` (the `bench` extra).

1. statistics, in FakeTensorMode: `MemTracker` (module memory), `RuntimeEstimator` (module
   times), `SACEstimator` (each module's ops: bytes, time, in-place and random groups, the
   trade-off curve that `pwlf` fits), gathered by `ilp_utils.aggregate_stats` and
   `parse_module_info` into a module graph;
2. `sac_ilp.sac_milp(graph, budget_gib, world_size, ac_units, fsdp_units)`: which blocks to
   checkpoint and what fraction of each one's activation memory to discard, under a per-rank
   budget in GiB (sharded parameters and gradients, activations);
3. per checkpointed block, `get_optimal_checkpointing_policy_per_module(stats, 1 - discard)`:
   save (1) or recompute (0) for each op in the order SACEstimator saw them;
4. applied with `torch.utils.checkpoint` (non-reentrant) and
   `create_selective_checkpoint_contexts`, a policy that counts the block's ops.

Where this departs from what a user would run, and why:
- Both estimators' runtime models are CUDA-only (`_roofline_estimate` asserts CUDA; the
  benchmark mode times kernels with CUDA events). `roofline` stands in for them: the same
  formula (max of FLOPs at the dtype's peak and bytes at the memory bandwidth), with the
  figures of remat's own "h100" target, so both planners rank ops with the same costs.
- `parse_module_info` asserts that every module ran once; a Llama block calls its
  `nn.Dropout` twice (after attention and after the MLP). `module_graph` keeps each
  module's first position in the module orders. Only leaf modules repeat, and the MILP
  never checkpoints a leaf.
"""
from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field

import torch

from remat.fx_passes.measuring.devices import device as target_device

WORLD = 2


def roofline(func, args, kwargs):
    """(output, milliseconds) of one op, as RuntimeEstimator's roofline computes it, with remat's
    H100 figures (its own needs CUDA): FLOPs at the output dtype's peak, or bytes at 3.35 TB/s."""
    from torch.utils._pytree import tree_flatten, tree_map
    from torch.utils.flop_counter import flop_registry

    h100 = target_device("h100")
    out = func(*args, **(kwargs or {}))
    tensors = [t for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor)]
    nbytes = sum(t.untyped_storage().nbytes() for t in tensors)
    flops = 0
    formula = flop_registry.get(func._overloadpacket)
    if formula is not None:
        def shape(x):
            return tree_map(lambda t: t.shape if isinstance(t, torch.Tensor) else t, x)

        flops = formula(*shape(args), **shape(kwargs or {}), out_val=shape(out))
    outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
    dtype = str(outs[0].dtype) if outs else "torch.float32"
    return out, max(flops / h100.peak_flops(dtype), nbytes / h100.bandwidth) * 1e3


@dataclass
class AutoSAC:
    """The statistics of one model: the module graph `sac_milp` takes, and each block's
    SACStats (keyed by the block's path in the model, "layers.0")."""

    graph: object
    stats: dict
    root: str
    blocks: list[str]


def module_graph(model: torch.nn.Module, inputs: tuple) -> AutoSAC:
    """Step 1: statistics of one forward and backward of `model` (built in FakeTensorMode)."""
    from torch._guards import active_fake_mode
    from torch.distributed._tools.ilp_utils import aggregate_stats, parse_module_info
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed._tools.runtime_estimator import RuntimeEstimator
    from torch.distributed._tools.sac_estimator import SACEstimator

    if active_fake_mode() is None:
        raise RuntimeError("module_graph: build the model and inputs under FakeTensorMode")
    memory, runtime, sac = MemTracker(), RuntimeEstimator(), SACEstimator()
    memory.track_external(model)
    with memory:
        with runtime("operator-level-cost-model"):
            runtime._estimate = roofline  # the CUDA-only roofline, replaced
            with sac("operator-level-cost-model"):
                sac._estimate_runtime = roofline
                model(*inputs).backward()
    info = aggregate_stats(model, memory, runtime, sac, torch.device("cpu"))
    for order in info["mod_order"]:  # a module called twice (dropout) appears twice
        info["mod_order"][order] = list(dict.fromkeys(info["mod_order"][order]))
    root = type(model).__name__
    blocks = [f"{root}.layers.{i}" for i in range(len(model.layers))]
    stats = {b.removeprefix(root + "."): sac.sac_mod_stats[b] for b in blocks}
    return AutoSAC(parse_module_info(info), stats, root, blocks)


def milp(auto: AutoSAC, budget_gib: float) -> tuple[dict[str, float], float, int]:
    """Step 2: sac_milp with the blocks as AC and FSDP units: (discard ratio per block path,
    recompute ms, its peak bound in bytes); ({}, 0, -1) when it finds no solution."""
    from torch.distributed._tools.sac_ilp import sac_milp

    ratios, ms, peak = sac_milp(auto.graph, budget_gib, world_size=WORLD, ac_units=auto.blocks,
                                fsdp_units=auto.blocks)
    return {k.removeprefix(auto.root + "."): r for k, r in ratios.items()}, ms, peak


def budget_range(auto: AutoSAC) -> tuple[float, float]:
    """(least budget sac_milp solves, its peak with nothing checkpointed), in GiB: its own
    memory model, `a_i + (P + G_i) / world` at each module, without discards."""
    nodes = auto.graph.nodes
    params = nodes[0]["param_per_module"]
    high = max(n["act_total"] + n["act_grad_per_module"] + (params + n["grad_total"]) / WORLD
               for n in nodes) / 2**30
    low, feasible = 0.0, high
    quiet = logging.getLogger("torch.distributed._tools.sac_ilp")
    quiet.disabled = True  # it logs an error for each budget it cannot solve
    try:
        for _ in range(30):  # bisection to 1e-9 of the range; each solve is a few ms
            middle = (low + feasible) / 2
            if milp(auto, middle)[2] >= 0:
                feasible = middle
            else:
                low = middle
    finally:
        quiet.disabled = False
    return feasible, high


@dataclass
class Decisions:
    """Steps 2 and 3 at one budget: per block, the ops to save in SACEstimator's order (an
    empty list recomputes the block whole); `notes` says where a step did not solve."""

    budget_gib: float
    ratios: dict[str, float] = field(default_factory=dict)
    ops: dict[str, list[int]] = field(default_factory=dict)
    recompute_ms: float = 0.0
    peak_bound: int = -1
    notes: list[str] = field(default_factory=list)


def decisions(auto: AutoSAC, budget_gib: float) -> Decisions:
    from torch.distributed._tools.sac_ilp import get_optimal_checkpointing_policy_per_module

    out = Decisions(budget_gib)
    out.ratios, out.recompute_ms, out.peak_bound = milp(auto, budget_gib)
    if out.peak_bound < 0:
        out.notes.append("sac_milp: no solution")
        return out
    for block, discard in out.ratios.items():
        keep = 1.0 - discard
        chosen = get_optimal_checkpointing_policy_per_module(auto.stats[block], keep)
        if not chosen:  # its MILP found no solution (it logs an error and returns [])
            out.notes.append(f"{block}: per-module MILP at {keep:.3f} gave [] (recomputes all)")
        out.ops[block] = chosen
    return out


def wrap_counting(model: torch.nn.Module, ops: dict[str, list[int]]) -> torch.nn.Module:
    """Step 4: checkpoint each block in `ops` with a policy that saves the k-th op it is called
    for when ops[block][k] is 1 (AutoSAC's decisions are by position); in place."""
    from torch.utils.checkpoint import (CheckpointPolicy, checkpoint,
                                        create_selective_checkpoint_contexts)

    for path, chosen in ops.items():
        module = model.get_submodule(path)

        def contexts(chosen=chosen):
            # One count per pass: torch 2.11 asks again in the recomputation (2.13 does not).
            counters = {False: itertools.count(), True: itertools.count()}

            def policy(ctx, op, *args, **kwargs):
                k = next(counters[ctx.is_recompute])
                save = k < len(chosen) and chosen[k] == 1
                return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE

            return create_selective_checkpoint_contexts(policy)

        forward = module.forward
        module.forward = (lambda fwd, ctx: lambda *a, **k: checkpoint(
            fwd, *a, use_reentrant=False, context_fn=ctx, **k))(forward, contexts)
    return model
