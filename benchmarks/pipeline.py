"""remat's per-stage plans against checkpointing every block and against none, per pipeline
schedule, on 2 gloo ranks (CPU), at the same budget.

    python benchmarks/pipeline.py [--schedules GPipe 1F1B ...] [--microbatches 4]

A small Llama (examples/llama.py: hidden 64, 4 layers, sequence 32, batch 8, dropout 0) cut
into stages by examples/llama_pipeline.py: 2 stages of 2 layers for GPipe and 1F1B, 4 of one
layer (2 a rank) for the multi-stage schedules. Per schedule, three runs of the same step:
- none: no checkpointing;
- every block: `torch.utils.checkpoint` (non-reentrant) around every decoder layer, as a user
  would write it (under a zero-bubble schedule, torch's W then recomputes each block once per
  parameter group: remat.fx_passes.eager.pipeline_apply);
- remat: `plan_pipeline(...)` at the rank's budget, `plan.apply(stages)`,
  `plan.prepare_runtime(pipeline_stages)`.
The budget of each rank: halfway between the least any of remat's candidate combinations
holds and what its cheapest one holds (AdamW; nothing reserved, 1 % margin).

Per rank: peak = what the rank holds for good (parameters, optimizer state, the runtime's
receive buffers, the batch) plus the allocator's peak of one step above that: the CPU
allocator's count on every thread (remat.fx_passes.measuring.every_thread, gloo's thread
included), with what the last step left for this one to free (a zero-bubble stage's receive
buffers' input gradients) counted as held at the start; the higher of two steps,
each checked to end at its gradients (every free seen; "(unclean)" otherwise); recompute =
the step's FLOPs (remat's counter: matmuls and attention) less those of the same step without
checkpointing; remat's prediction beside its measurement.
Timing-free: a busy machine changes the run time only (a few minutes on 2 cores).
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
from dataclasses import replace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import remat  # noqa: E402
from examples.llama import LLAMA_TEST, llama  # noqa: E402
from examples.llama_pipeline import (llama_stages, pipeline_loss, pipeline_runtime,  # noqa: E402
                                     rank_step, receive_buffers)

CONFIG = replace(LLAMA_TEST, layers=4, dropout=0.0, seq=32, hidden=64, mlp=176)
WORLD = 2
BATCH = 8
SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble",
             "DualPipeV")


def stage_count(schedule: str) -> int:
    return WORLD if schedule in ("GPipe", "1F1B") else 2 * WORLD


def plan_for(schedule: str, microbatches: int, reuse=None):
    from remat.planner.parallel.pipeline import PipelineSpec, plan_pipeline

    model, (tokens, targets) = llama(CONFIG, batch=BATCH, data_seed=1)
    stages = llama_stages(model, stage_count(schedule))
    mb = BATCH // microbatches
    args = dict(example_target=targets[:mb], loss_fn=pipeline_loss, levels=4,
                training=remat.Training(reserve=0, fragmentation=0.01),
                spec=PipelineSpec(schedule=schedule, microbatches=microbatches))
    free = plan_pipeline(stages, (tokens[:mb],), budget=10**12, reuse=reuse, **args)
    budget = [int((free.smallest[r] + free.peak(r) / 0.99) // 2) for r in range(WORLD)]
    return plan_pipeline(stages, (tokens[:mb],), budget=budget, reuse=free, **args), free


def run(rank: int, schedule: str, plan, variant: str, microbatches: int) -> dict:
    from torch.utils.checkpoint import checkpoint

    from remat.fx_passes.measuring.every_thread import addresses, every_thread_reading
    from remat.fx_passes.measuring.flops import FlopCounter

    model, (tokens, targets) = llama(CONFIG, batch=BATCH, data_seed=1)
    modules = llama_stages(model, plan.order.stages)
    mine = plan.order.stages_of(rank)
    if variant == "every block":
        for s in mine:
            for layer in modules[s].layers.values():
                layer.forward = (lambda f: lambda *a: checkpoint(f, *a, use_reentrant=False))(
                    layer.forward)
    elif variant == "remat":
        plan.apply(modules)
    stages, runtime = pipeline_runtime(modules, mine, schedule, microbatches,
                                       plan if variant == "remat" else None)
    params = [p for s in stages for p in s.submod.parameters()]
    opt = torch.optim.AdamW(params, lr=1e-2)
    step, batch = rank_step(runtime, plan.order.stages, mine, tokens, targets)

    for _ in range(2):
        step()
        opt.step()
        opt.zero_grad(set_to_none=True)
    state = [t for st in opt.state.values() for t in st.values() if t.dim()]
    held = _bytes(params) + _bytes(state) + _bytes(receive_buffers(stages)) + _bytes(batch)
    peaks, clean = [], True
    for _ in range(2):
        gc.collect()
        dist.barrier()
        reading = every_thread_reading(step, held=addresses(
            [*params, *state, *receive_buffers(stages), *batch]))
        peaks.append(reading.from_before + reading.peak)
        clean &= reading.end == _bytes(p.grad for p in params if p.grad is not None)
        opt.zero_grad(set_to_none=True)
    dist.barrier()
    counter = FlopCounter()
    with counter:
        step()
    opt.zero_grad(set_to_none=True)
    return {"peak": held + max(peaks), "step": max(peaks), "flops": counter.total,
            "clean": clean}


def _bytes(tensors) -> int:
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in tensors}.values())


def worker(rank: int, init: str, plans: dict, microbatches: int, out: str) -> None:
    from remat.fx_passes.measuring.every_thread import track_every_thread

    track_every_thread()  # before the job allocates: the readings see its every free
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
    try:
        torch.set_num_threads(1)
        results = {}
        for schedule, plan in plans.items():
            for variant in ("none", "every block", "remat"):
                try:
                    results[schedule, variant] = run(rank, schedule, plan, variant,
                                                     microbatches)
                except Exception as e:  # shown in the table
                    results[schedule, variant] = {"error": f"{type(e).__name__}: {e}"[:80]}
        torch.save(results, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedules", nargs="+", default=list(SCHEDULES))
    parser.add_argument("--microbatches", type=int, default=4)
    args = parser.parse_args(argv)
    plans = {}
    previous = None
    for schedule in args.schedules:
        reuse = previous if previous is not None and schedule in ("GPipe", "1F1B") \
            and len(previous.stages) == stage_count(schedule) else None
        plans[schedule], free = plan_for(schedule, args.microbatches, reuse)
        previous = free if schedule in ("GPipe", "1F1B") else previous
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(worker, args=(f"file://{tmp}/rendezvous", plans, args.microbatches,
                               f"{tmp}/out"), nprocs=WORLD, join=True)
        measured = [torch.load(f"{tmp}/out.{r}") for r in range(WORLD)]
    k = lambda b: f"{b / 1e3:,.0f}"  # noqa: E731
    print(f"Llama hidden {CONFIG.hidden}, {CONFIG.layers} layers, seq {CONFIG.seq}, batch "
          f"{BATCH} in {args.microbatches} micro-batches, 2 gloo ranks; KB and MFLOP per rank")
    print("| schedule | rank (stages: in flight) | budget | none: peak | every block: peak, "
          "recompute | remat: predicted, peak, recompute | remat's stage plans |")
    print("|---|---|---|---|---|---|---|")
    for schedule, plan in plans.items():
        for rank in range(WORLD):
            got = {v: measured[rank][schedule, v] for v in ("none", "every block", "remat")}
            if any("error" in g for g in got.values()):
                print(f"| {schedule} | {rank} | " + " | ".join(
                    g.get("error", "") for g in got.values()) + " |")
                continue
            base = got["none"]["flops"]
            rec = lambda v: (got[v]["flops"] - base) / 1e6  # noqa: E731

            def fits(v: str) -> str:  # over the budget; a reading that missed a free
                return ("" if got[v]["peak"] <= plan.budgets[rank] else " (over)") \
                    + ("" if got[v]["clean"] else " (unclean)")

            flight = ", ".join(f"{s}: {plan.ranks[rank].in_flight.get(s, 0)}"
                               for s in plan.order.stages_of(rank))
            names = "; ".join(f"{s.stage}: {s.chosen.name}" for s in plan.stages
                              if s.rank == rank)
            print(f"| {schedule} | {rank} ({flight}) | {k(plan.budgets[rank])} | "
                  f"{k(got['none']['peak'])}{fits('none')} | "
                  f"{k(got['every block']['peak'])}{fits('every block')}, "
                  f"{rec('every block'):.1f} | {k(plan.peak(rank))}, "
                  f"{k(got['remat']['peak'])}{fits('remat')}, {rec('remat'):.1f} | {names} |")


if __name__ == "__main__":
    main()
