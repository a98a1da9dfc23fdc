"""torchtitan's Llama3 (or Qwen3-MoE) planned by remat and trained with FSDP2 on 2 gloo ranks on
the CPU, against torchtitan's own activation checkpointing (none, full, selective).

An optional extra, not part of the test suite (torchtitan imports triton, ~900 MB)::

    pip install torchtitan==0.3.0 triton==3.8.0     # keeps torch 2.13.0
    python examples/torchtitan_llama.py             # about 90 s on 2 CPU cores
    python examples/torchtitan_llama.py --model qwen3-moe

Every configuration goes through torchtitan's own `parallelize_llama` / `parallelize_qwen3`
(activation checkpointing, then `fully_shard` per block). remat's plan goes in where
torchtitan's checkpointing does: `RematAC` is a torchtitan `ActivationCheckpointing` whose
`apply(model)` wraps each block with the plan's selective policy. Rank 0 makes remat's eager
plan (least recomputed FLOPs) at the whole-step memory that torchtitan's selective and full
checkpointing were measured to take, or at remat's least where that is below it, and
`remat.broadcast_plan` gives the other rank the same plan.

Per configuration it prints the FLOPs recomputed in one step (the step's FLOPs counted as they
run, less the step's without checkpointing), each rank's whole-step memory (what it holds when
the step starts plus the allocator's peak during the step: torch.profiler's memory events),
remat's predictions of both, and the losses, which must equal those without checkpointing.
The traps of torchtitan 0.3.0 on a CPU (flex attention, "cuda" as its device type, gloo and
PREMUL_SUM, a CUDA-only Trainer) are in docs/torchtitan.md.
"""
from __future__ import annotations

import argparse
import gc
import logging
import os
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import remat  # noqa: E402
from tests.allocator import allocator_peak  # noqa: E402  (every free counted: FSDP2 frees blocks
#   allocated before the window, which remat's own pairing would drop)
from examples.torchtitan_models import (SEQ, VOCAB, cpu_patches,  # noqa: E402
                                        selective_ac_saving_cpu_attention, torchtitan_model)

WORLD = 2
STEPS = 3
BATCH = 2  # per rank
TIMEOUT = 900  # seconds for the whole job: a hung collective ends it
TIME_LIMIT = 15  # seconds for each of remat's plans


def build(config) -> nn.Module:
    """The model, the same weights on every rank and at every call."""
    torch.manual_seed(0)
    model = config.build()
    model.init_states(buffer_device=torch.device("cpu"))
    return model


class LanguageModelStep(nn.Module):
    """The step remat plans: the model's logits and torchtitan's cross-entropy (its sum over
    tokens, here divided by their number)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, tokens, labels):
        from torchtitan.components.loss import cross_entropy_loss

        return cross_entropy_loss(self.model(tokens), labels) / labels.numel()


def rematac():
    """`RematAC`: remat's per-block policies as a torchtitan activation-checkpointing option
    (defined on first use: torchtitan is optional)."""
    from torchtitan.distributed.activation_checkpoint import ActivationCheckpointing

    class RematAC(ActivationCheckpointing):
        @dataclass(kw_only=True, slots=True)
        class Config(ActivationCheckpointing.Config):
            policies: dict = field(default_factory=dict)
            """Block path in the torchtitan model ("layers.0") -> remat's BlockPolicy."""

        def apply(self, model: nn.Module) -> None:
            from remat.fx_passes.eager.apply import apply_eager

            apply_eager(model, self.config.policies)

    return RematAC


def titan_policies(plan) -> dict:
    """The plan's block policies, named as in the torchtitan model (the plan was made on
    `LanguageModelStep`, whose `model.` prefix they drop)."""
    return {path.removeprefix("model."): replace(policy, path=path.removeprefix("model."))
            for path, policy in plan.block_policies.items()}


def parallelize(model: nn.Module, parallelize_fn, parallel_dims, ac_config) -> nn.Module:
    """torchtitan's own path: activation checkpointing, then FSDP2 per block and the root."""
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig

    model = parallelize_fn(
        model, parallel_dims=parallel_dims,
        training=TrainingConfig(mixed_precision_param="float32"),
        parallelism=ParallelismConfig(data_parallel_shard_degree=WORLD,
                                      spmd_backend="partial_dtensor"),
        compile_config=CompileConfig(), ac_config=ac_config, dump_folder="")
    for module in model.modules():
        if isinstance(module, FSDPModule):  # gloo has no PREMUL_SUM; a sum is the same here
            module.set_force_sum_reduction_for_comms(True)
    return model


def batch(rank: int, step: int):
    g = torch.Generator().manual_seed(1000 * rank + step)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return tokens, torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def training_state() -> remat.Training:
    """What each rank holds besides activations, as `fully_shard` and AdamW make it. FSDP2's
    prefetch as torchtitan leaves it (none set): gloo's collectives on a CPU run when called,
    so no block is gathered ahead in the forward, and FSDP2's implicit backward prefetch
    gathers one ahead in the backward. No runtime reserve or fragmentation margin on the
    CPU: the plan's peak is the step's own."""
    return remat.Training(data_parallel=WORLD, zero_stage=3, prefetch=0, backward_prefetch=1,
                          reserve=0, fragmentation=0.0)


def storage_bytes(tensors) -> int:
    storages = [(t.to_local() if hasattr(t, "to_local") else t).untyped_storage() for t in tensors]
    return sum({s.data_ptr(): s.nbytes() for s in storages}.values())


def run(model: nn.Module, rank: int) -> dict:
    """STEPS AdamW steps (the losses), then one step measured by the allocator and one by a
    FLOP counter (separate runs: a counter must not change what the allocator sees)."""
    from torchtitan.components.loss import cross_entropy_loss

    from remat.fx_passes.measuring.flops import FlopCounter

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def step(tokens, labels):
        loss = cross_entropy_loss(model(tokens), labels) / labels.numel()
        loss.backward()
        return float(loss)

    losses = []
    for k in range(STEPS):
        losses.append(step(*batch(rank, k)))
        opt.step()
        opt.zero_grad(set_to_none=True)
    inputs = batch(rank, STEPS)
    # What the rank holds as a step starts: its parameter shards, AdamW's state, the batch.
    held = (storage_bytes(model.parameters())
            + storage_bytes(t for s in opt.state.values() for t in s.values()
                            if isinstance(t, torch.Tensor)) + storage_bytes(inputs))
    peaks = []
    for _ in range(5):  # the least of five: gloo's own buffers come and go with timing
        gc.collect()
        dist.barrier()  # both ranks start together: a rank kept waiting holds gloo's buffers
        peaks.append(allocator_peak(lambda: step(*inputs))[0])
        opt.zero_grad(set_to_none=True)
    with FlopCounter() as counter:
        step(*inputs)
    opt.zero_grad(set_to_none=True)
    return {"losses": losses, "held": held, "peak": min(peaks), "flops": counter.total}


def plan_at(config, budget: int, rank: int):
    """Rank 0 plans the eager step at `budget` bytes per rank (at the least budget remat finds
    feasible, where that is more); every rank gets the plan, and the budget used."""
    from remat.solvers import SolverOptions

    model = LanguageModelStep(build(config))
    plan = None
    if rank == 0:
        # FLOPs are what the table compares (by default remat minimizes recompute time on the
        # target device, a roofline of an H100).
        options = SolverOptions(time_limit=TIME_LIMIT, objective="flops")
        plan_budget = partial(remat.optimize, model, example_inputs=batch(0, 0),
                              execution="eager", training=training_state(),
                              solver_options=options)
        try:
            plan = plan_budget(budget=budget)
        except remat.BudgetError as e:
            budget = e.smallest
            plan = plan_budget(budget=budget)
    sent = [budget, None if plan is None else whole_block_peak(plan)]
    dist.broadcast_object_list(sent, src=0)
    return remat.broadcast_plan(plan if rank == 0 else None, model=model), *sent


def whole_block_peak(plan) -> int:
    """remat's prediction for the policy that caches nothing: torchtitan's full checkpointing."""
    from remat.solvers.timeline.eager import eager_schedule

    return plan.prepared.step_memory(eager_schedule(plan.eager_problem, plan.structure, ()),
                                     None).total


def worker(rank: int, init: str, out: str, model_name: str, layers: int) -> None:
    torch.set_num_threads(1)  # two ranks on two cores
    logging.disable(logging.INFO)  # torchtitan's and remat's progress
    warnings.filterwarnings("ignore", "In CPU autocast")  # the MoE router's float32 autocast
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
    try:
        cpu_patches()
        from torchtitan.distributed import ParallelDims
        from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

        dims = ParallelDims(dp_replicate=1, dp_shard=WORLD, cp=1, tp=1, pp=1, ep=1,
                            world_size=WORLD, spmd_backend="partial_dtensor")
        dims.build_mesh()
        config, parallelize_fn = torchtitan_model(model_name, layers)
        titan = partial(parallelize, parallelize_fn=parallelize_fn, parallel_dims=dims)
        results = {}
        saving_attention = selective_ac_saving_cpu_attention()
        for name, ac in (("none", None), ("torchtitan full", FullAC.Config()),
                         ("torchtitan selective", SelectiveAC.Config()),
                         ("torchtitan selective+attention", saving_attention.Config())):
            results[name] = run(titan(build(config), ac_config=ac), rank)
        # remat at the memory each torchtitan option took (the larger rank's), or at remat's
        # least budget (`floor`) where that is more: a plan made once per budget.
        RematAC, floor, made = rematac(), 0, {}
        for baseline in ("full", "selective", "selective+attention"):
            everyone = [None] * WORLD
            titan_row = results[f"torchtitan {baseline}"]
            dist.all_gather_object(everyone, titan_row["held"] + titan_row["peak"])
            asked = max(everyone)
            if max(asked, floor) not in made:
                start = time.perf_counter()
                plan, budget, whole_blocks = plan_at(config, max(asked, floor), rank)
                results["torchtitan full"]["predicted"] = whole_blocks
                floor = budget if budget > asked else floor
                planned = run(titan(build(config), ac_config=RematAC.Config(
                    policies=titan_policies(plan))), rank)
                made[budget] = {**planned, "budget": budget,
                                "predicted": plan.peak - plan.memory.margin,
                                "predicted_flops": plan.recompute_flops,
                                "status": plan.status.name, "plan_s": time.perf_counter() - start}
            results[f"remat @ {baseline}"] = {**made[max(asked, floor)], "asked": asked}
        torch.save(results, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def table(measured: list[dict]) -> str:
    """One row per configuration; measured per rank (rank 0 / rank 1)."""
    from tabulate import tabulate

    nones = [m["none"] for m in measured]
    scale = max(abs(x) for x in nones[0]["losses"])
    rows = []
    for name in measured[0]:
        ranks = [m[name] for m in measured]
        first = ranks[0]
        recompute = " / ".join(f"{(r['flops'] - n['flops']) / 1e6:.2f}"
                               for r, n in zip(ranks, nones))
        whole = " / ".join(f"{r['held'] + r['peak']:,}" for r in ranks)
        diff = max(abs(a - b) for r, n in zip(ranks, nones)
                   for a, b in zip(r["losses"], n["losses"]))
        predicted = f"{first['predicted']:,}" if "predicted" in first else "-"
        predicted_flops = f"{first['predicted_flops'] / 1e6:.2f}" if "budget" in first else "-"
        if "budget" in first:
            below = (f"; asked {first['asked']:,}, below remat's least"
                     if first["budget"] != first["asked"] else "")
            predicted += f" (budget {first['budget']:,}{below})"
        rows.append([name, recompute, predicted_flops, whole, predicted,
                     " ".join(f"{x:.4f}" for x in first["losses"]),
                     f"{diff:.1e}" + (" (same)" if diff <= 1e-6 * scale else " (DIFFERENT)")])
    return tabulate(rows, tablefmt="github", headers=[
        "configuration", "recompute MFLOP, rank 0 / 1", "remat's predicted MFLOP",
        "whole-step peak B, rank 0 / 1", "remat's predicted peak B", "rank 0's losses",
        "max |loss - none's|"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("llama3", "qwen3-moe"), default="llama3")
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    try:
        import torchtitan  # noqa: F401
    except ImportError:
        sys.exit("torchtitan is not installed: pip install torchtitan==0.3.0 triton==3.8.0")
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result")
        context = mp.spawn(worker, args=(f"file://{tmp}/rendezvous", out, args.model, args.layers),
                           nprocs=WORLD, join=False)
        while not context.join(timeout=5):
            if time.perf_counter() - start > TIMEOUT:
                for p in context.processes:
                    p.terminate()
                sys.exit(f"timed out after {TIMEOUT} s")
        measured = [torch.load(f"{out}.{rank}") for rank in range(WORLD)]
    print(table(measured))
    plans = {row["budget"]: row for row in measured[0].values() if "status" in row}
    for budget, row in plans.items():
        print(f"remat's plan at {budget:,} B: {row['status']}, planned and sent in "
              f"{row['plan_s']:.0f} s")
    print(f"{args.model}, {args.layers} layers: {time.perf_counter() - start:.0f} s in all")


if __name__ == "__main__":
    main()
