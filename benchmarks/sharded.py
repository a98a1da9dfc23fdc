"""remat's eager plans against PyTorch's AutoSAC, under FSDP2 on 2 gloo ranks (CPU).

    pip install pulp      # benchmark-only: torch.distributed._tools.sac_ilp needs it
    python benchmarks/sharded.py [--layers 4] [--dropout 0.1]

A tiny Llama-style model (tests/llama_tiny.py) trains one step per configuration:
no checkpointing; `torch.utils.checkpoint` on every block; PyTorch's AutoSAC at three memory
budgets; remat's eager plan at the same three budgets. Per configuration it prints each rank's
allocator peak under FSDP2 (torch.profiler memory events, one forward and backward), the
single-process activation peak (allocator) and the recompute FLOPs (FlopCounterMode, the
step's FLOPs minus those of the step without checkpointing), and whether the gradients equal
plain PyTorch's.

What "AutoSAC" is here: `SACEstimator` (per-op statistics of each block, in FakeTensorMode)
and `get_optimal_checkpointing_policy_per_module` (its per-block MILP: which ops to save under
a fraction of the block's saved bytes), applied, as AutoSAC's policies are, by counting each
block's ops. Its runtime estimator is CUDA-only: a roofline (H100 figures) stands in for it.
The module-level MILP (`sac_milp`, which picks the fractions) is not run: the three fractions
are given. remat's budget for a row is AutoSAC's measured single-process activation peak at
that fraction (where AutoSAC runs), so "remat fits wherever AutoSAC fits" is checked on the
same bytes; where AutoSAC fails, the budget interpolates the fraction between checkpointing
every block and none.
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys
import tempfile
from functools import partial

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from remat.fx_passes.allocator import allocator_peak  # noqa: E402
from remat.fx_passes.eager_policy import apply_eager  # noqa: E402
from tests.llama_tiny import TinyLlamaConfig, tiny_llama  # noqa: E402

FRACTIONS = (0.25, 0.5, 0.75)
WORLD = 2


def _roofline(func, args, kwargs):
    """A stand-in for AutoSAC's CUDA-only roofline: FLOPs at 989 TFLOP/s or bytes at 3.35 TB/s."""
    from torch.utils._pytree import tree_flatten, tree_map
    from torch.utils.flop_counter import flop_registry

    out = func(*args, **kwargs)
    flops = 0
    formula = flop_registry.get(func._overloadpacket)
    if formula is not None:
        shape = partial(tree_map, lambda x: x.shape if isinstance(x, torch.Tensor) else x)
        flops = formula(*shape(args), **shape(kwargs), out_val=shape(out))
    nbytes = sum(t.untyped_storage().nbytes() for t in tree_flatten((args, kwargs, out))[0]
                 if isinstance(t, torch.Tensor))
    return out, max(flops / 989e12, nbytes / 3.35e12) * 1e3


def autosac_decisions(config: TinyLlamaConfig, batch: int) -> dict[float, dict[str, list]]:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.sac_estimator import SACEstimator
    from torch.distributed._tools.sac_ilp import get_optimal_checkpointing_policy_per_module

    with FakeTensorMode():
        model, inputs = tiny_llama(config, batch=batch)
        estimator = SACEstimator()
        with estimator("operator-level-cost-model"):
            estimator._estimate_runtime = _roofline
            model(*inputs).backward()
    stats = {name.removeprefix("TinyLlama."): s for name, s in estimator.sac_mod_stats.items()
             if name.startswith("TinyLlama.layers.")}
    return {f: {block: get_optimal_checkpointing_policy_per_module(s, f)
                for block, s in stats.items()} for f in FRACTIONS}


def wrap_counting(model, decisions: dict[str, list]):
    """Checkpoint each block with a policy that saves the k-th op the policy sees when
    decisions[k] is 1, as AutoSAC's policies do; an empty list recomputes everything."""
    from torch.utils.checkpoint import (CheckpointPolicy, checkpoint,
                                        create_selective_checkpoint_contexts)

    for path, chosen in decisions.items():
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


def build(config, wrapping):
    model, _ = tiny_llama(config)
    kind, payload = wrapping
    if kind == "remat":
        apply_eager(model, payload)
    elif kind == "counting":
        wrap_counting(model, payload)
    return model


def single_process(config, batch, wrapping, inputs):
    """(activation peak, FLOPs, gradients, error) of one step without sharding."""
    from torch.utils.flop_counter import FlopCounterMode

    from remat.fx_passes.flops import register_cpu_attention

    register_cpu_attention()
    try:
        model = build(config, wrapping)

        def step():
            torch.manual_seed(11)
            model(*inputs).backward()

        peak, _ = allocator_peak(step)
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        model = build(config, wrapping)
        counter = FlopCounterMode(display=False)
        with counter:
            torch.manual_seed(11)
            model(*inputs).backward()
        return peak, counter.get_total_flops(), grads, None
    except Exception as e:  # noqa: BLE001 - the table reports what breaks
        return None, None, None, f"{type(e).__name__}: {str(e).splitlines()[0][:70]}"


def _rank(rank, init, config, batch, wrappings, results):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (WORLD,))
    out = {}
    g = torch.Generator().manual_seed(rank)
    inputs = (torch.randint(0, config.vocab, (batch, config.seq), generator=g),
              torch.randint(0, config.vocab, (batch, config.seq), generator=g))
    for name, wrapping in wrappings.items():
        try:
            model = build(config, wrapping)
            for layer in model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)

            def step():
                torch.manual_seed(11 + rank)
                model(*inputs).backward()

            out[name], _ = allocator_peak(step)
        except Exception as e:  # noqa: BLE001
            out[name] = f"{type(e).__name__}"
        dist.barrier()
    torch.save(out, f"{results}.{rank}")
    dist.destroy_process_group()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--objective", default="flops", choices=["flops", "time"],
                        help="what remat minimizes (the table counts FLOPs)")
    args = parser.parse_args(argv)
    import remat
    from remat.planner.eager_plan import plan_eager_mode
    from remat.planner.optimize import prepare
    from remat.solvers import SolverOptions

    config = TinyLlamaConfig(hidden=64, mlp=176, seq=64, layers=args.layers,
                             dropout=args.dropout)
    model, inputs = tiny_llama(config, batch=args.batch)
    blocks = [f"layers.{i}" for i in range(args.layers)]
    rows: dict[str, tuple] = {}
    wrappings = {"no checkpointing": ("none", None),
                 "checkpoint every block": ("counting", {b: [] for b in blocks})}
    decisions = autosac_decisions(config, args.batch)
    for f in FRACTIONS:
        wrappings[f"AutoSAC {f:.2f}"] = ("counting", decisions[f])
    for name, wrapping in wrappings.items():
        rows[name] = single_process(config, args.batch, wrapping, inputs)

    training = remat.Training(data_parallel=WORLD, zero_stage=3)
    prepared = prepare(model, inputs, training=training)
    plan = partial(plan_eager_mode, model, prepared, budget=None, target="h100",
                   solver="optimal", solver_options=SolverOptions(time_limit=20, objective=args.objective), blocks=None,
                   example_inputs=inputs)
    none_peak, full_peak = rows["no checkpointing"][0], rows["checkpoint every block"][0]
    predicted = {}
    for f in FRACTIONS:
        autosac = rows[f"AutoSAC {f:.2f}"][0]
        budget = autosac if autosac is not None else int(full_peak + f * (none_peak - full_peak))
        name = f"remat eager at {budget:,} B"
        try:
            planned = plan(activation_budget=budget)
        except remat.errors.RematError as e:
            rows[name] = (None, None, None, f"{type(e).__name__}: {str(e)[:60]}")
            continue
        predicted[name] = planned.activation_peak
        wrappings[name] = ("remat", planned.block_policies)
        rows[name] = single_process(config, args.batch, wrappings[name], inputs)

    with tempfile.TemporaryDirectory() as tmp:
        results = os.path.join(tmp, "r")
        mp.spawn(_rank, args=(f"file://{tmp}/rv", config, args.batch, wrappings, results),
                 nprocs=WORLD, join=True)
        sharded = [torch.load(f"{results}.{r}") for r in range(WORLD)]

    base_flops = rows["no checkpointing"][1]
    reference = rows["no checkpointing"][2]
    print(f"tiny Llama: {args.layers} layers, hidden 64, seq 64, batch {args.batch} per rank, "
          f"dropout {args.dropout}; FSDP2 on {WORLD} gloo ranks (CPU); remat minimizes "
          f"recompute {args.objective}")
    header = ("configuration", "rank 0 peak", "rank 1 peak", "activation peak",
              "remat predicted", "recompute GFLOP", "gradients")
    print(" | ".join(header))
    print(" | ".join("---" for _ in header))
    for name, (peak, flops, grads, error) in rows.items():
        if error is not None:
            print(f"{name} | - | - | - | - | - | fails: {error}")
            continue
        same = all(torch.allclose(grads[n], reference[n], rtol=1e-5, atol=1e-7)
                   for n in reference)
        ranks = [s.get(name, "-") for s in sharded]
        ranks = [f"{r:,}" if isinstance(r, int) else str(r) for r in ranks]
        print(f"{name} | {ranks[0]} | {ranks[1]} | {peak:,} | "
              f"{predicted.get(name, '-') if name not in predicted else f'{predicted[name]:,}'} | "
              f"{(flops - base_flops) / 1e9:.4f} | {'equal' if same else 'DIFFER'}")


if __name__ == "__main__":
    main()
