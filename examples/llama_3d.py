"""examples/llama.py's decoder trained in 3-D on gloo (CPU): pipeline stages x FSDP2 x tensor
parallel, planned per rank by remat and judged against the same job without remat.

    python examples/llama_3d.py [--pp 2 --dp 2 --tp 2] [--schedules GPipe 1F1B] [--microbatches 4]

The mesh is ``(pp, dp, tp)`` (`init_device_mesh`, names "pp", "dp", "tp"). Each rank:
the whole model built with the same weights, tensor-parallelized over "tp"
(examples/llama_tensor_parallel.py, no sequence parallelism: the stages compute their rotary
tables for the sequence they receive), cut into `pp` stages (examples/llama_pipeline.py),
remat's plan applied to its stage's blocks, then (dp > 1) `fully_shard` over "dp" of each
layer and of the stage with ``reshard_after_forward=False`` (torchtitan's choice under a
pipeline: the parameters are gathered once a step, not once a micro-batch), and run with
torch's schedule over "pp". Each data-parallel replica trains on its own batch.

The plan: `plan_pipeline` in one process, on the stages of the model parallelized on a fake
process group of the job's size (no job needed), with ``Training(tensor_parallel=tp,
data_parallel=dp, zero_stage=3, reshard_after_forward=False)``; every rank of a pipeline rank's
(dp, tp) group runs the same plan. The budget of each pipeline rank: halfway between the least
any of remat's candidate combinations holds and what no checkpointing holds (AdamW; nothing
reserved, 1 % margin).

Per rank the script prints: its coordinates, the budget, remat's predicted peak, the allocator's
(what the rank holds when the step starts plus the allocator's peak of one step above it,
counted on every thread, gloo's included: remat.fx_passes.measuring.every_thread; the highest
of `--readings` steps), how far the measurement is over the prediction, and whether the gradients
of a step equal those of the same job without remat (bitwise, and the worst relative
difference of the parameters after two AdamW steps).
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import remat  # noqa: E402
from examples.llama import LLAMA_TEST, llama  # noqa: E402
from examples.llama_pipeline import (llama_stages, pipeline_loss, pipeline_runtime,  # noqa: E402
                                     rank_step, receive_buffers)
from examples.llama_tensor_parallel import parallelize_llama  # noqa: E402
from remat.planner.parallel.fsdp import reduce_peak  # noqa: E402

# benchmarks/pipeline.py's model: hidden 64, 4 layers, sequence 32.
CONFIG = replace(LLAMA_TEST, layers=4, dropout=0.0, seq=32, hidden=64, mlp=176)
READINGS = 3  # profiled steps a rank, each judged


@dataclass(frozen=True)
class Job:
    pp: int = 2
    dp: int = 2
    tp: int = 2
    schedule: str = "1F1B"
    microbatches: int = 4
    batch: int = 8
    """Each data-parallel replica's batch (all its micro-batches together)."""
    config: object = CONFIG
    steps: int = 2

    @property
    def world(self) -> int:
        return self.pp * self.dp * self.tp

    def training(self) -> remat.Training:
        sharded = dict(data_parallel=self.dp, zero_stage=3, reshard_after_forward=False) \
            if self.dp > 1 else {}
        return remat.Training(reserve=0, fragmentation=0.01, tensor_parallel=self.tp,
                              sequence_parallel=False, **sharded)

    def coords(self, rank: int) -> tuple[int, int, int]:
        return rank // (self.dp * self.tp), rank // self.tp % self.dp, rank % self.tp


def job_mesh(job: Job):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (job.pp, job.dp, job.tp), mesh_dim_names=("pp", "dp", "tp"))


def job_stages(job: Job, mesh, data_seed: int = 1):
    """The stage modules of the model tensor-parallelized over the mesh's "tp", and a batch."""
    model, (tokens, targets) = llama(job.config, batch=job.batch, data_seed=data_seed)
    if job.tp > 1:
        parallelize_llama(model, mesh["tp"], sequence_parallel=False)
    return llama_stages(model, job.pp), tokens, targets


def plan_job(job: Job, levels: int = 3, reuse=None, solver_options=None):
    """remat's plan for every pipeline rank, made in this process on a fake process group, and
    the plan without a budget (its candidates serve `reuse` for another schedule);
    `solver_options` for the stages' eager plans (None: the defaults)."""
    from remat.planner.parallel.pipeline import PipelineSpec, plan_pipeline
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=job.world)
    try:
        stages, tokens, targets = job_stages(job, job_mesh(job))
        mb = job.batch // job.microbatches
        args = dict(example_target=targets[:mb], loss_fn=pipeline_loss, levels=levels,
                    training=job.training(), solver_options=solver_options,
                    spec=PipelineSpec(schedule=job.schedule, microbatches=job.microbatches))
        free = plan_pipeline(stages, (tokens[:mb],), budget=10**12, reuse=reuse, **args)
        budget = [int((free.smallest[r] + free.peak(r) / 0.99) // 2) for r in range(job.pp)]
        return plan_pipeline(stages, (tokens[:mb],), budget=budget, reuse=free, **args), free
    finally:
        dist.destroy_process_group()


def _shard(modules, mine, mesh) -> None:
    from torch.distributed.fsdp import fully_shard

    for s in mine:
        for layer in modules[s].layers.values():
            fully_shard(layer, mesh=mesh["dp"], reshard_after_forward=False)
        fully_shard(modules[s], mesh=mesh["dp"], reshard_after_forward=False)


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _bytes(tensors) -> int:
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in map(_local, tensors)}.values())


def train_rank(rank: int, job: Job, mesh, plan, measure: bool,
               readings_wanted: int = READINGS) -> dict:
    """This rank's part of the job, with remat's plan (`measure`) or without: the gradients of
    the first step, the parameters after `job.steps` AdamW steps and, with the plan, what the
    rank holds when a step starts and the allocator's peak of a step above it, counted on
    every thread (the most of `readings_wanted` steps; each reading's (peak above what the
    rank holds, end, gradients' bytes) in "readings")."""
    pp, dp, _ = job.coords(rank)
    modules, tokens, targets = job_stages(job, mesh, data_seed=1 + dp)
    mine = plan.order.stages_of(pp)
    if measure:
        plan.apply(modules)  # on the parallelized blocks, before fully_shard
    if job.dp > 1:
        _shard(modules, mine, mesh)
    stages, runtime = pipeline_runtime(modules, mine, job.schedule, job.microbatches,
                                       plan if measure else None, group=mesh["pp"].get_group())
    params = [p for s in stages for p in s.submod.parameters()]
    opt = torch.optim.AdamW(params, lr=1e-2)
    step, batch = rank_step(runtime, plan.order.stages, mine, tokens, targets)

    named = [(f"{s}.{n}", p) for s in mine for n, p in modules[s].named_parameters()]
    grads = None
    for k in range(job.steps):
        torch.manual_seed(1000 * (pp * job.dp + dp) + k)  # the same dropout in both jobs
        step()
        if grads is None:
            grads = {n: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                     for n, p in named}
        opt.step()
        opt.zero_grad(set_to_none=True)
    out = {"grads": grads, "params": {n: p.full_tensor().detach().clone()
                                      if hasattr(p, "full_tensor") else p.detach().clone()
                                      for n, p in named}}
    if not measure:
        return out
    from remat.fx_passes.measuring.every_thread import addresses, every_thread_reading

    state = [t for st in opt.state.values() for t in st.values() if _local(t).dim()]
    held = _bytes(params) + _bytes(state) + _bytes(receive_buffers(stages)) + _bytes(batch)
    readings = []
    # Each reading counts the allocator on every thread: a collective's output (an
    # all-reduce's clone, an all-gather's flat buffer) whose last reference gloo's worker
    # thread drops is freed on a thread the profiler does not record (docs/parallelism.md).
    for _ in range(readings_wanted):
        gc.collect()
        dist.barrier()
        torch.manual_seed(7)
        reading = every_thread_reading(step, held=addresses(
            [*map(_local, params), *map(_local, state), *receive_buffers(stages), *batch]))
        # Checked by the caller: the step left its gradients (every free seen).
        readings.append((reading.from_before + reading.peak, reading.end,
                         _bytes(p.grad for p in params if p.grad is not None)))
        opt.zero_grad(set_to_none=True)
    # The verdict rests on every reading: the highest.
    return {**out, "held": held, "peak": max(p for p, _, _ in readings), "readings": readings}


def compare(plain: dict, planned: dict) -> dict:
    """Bitwise equality of the first step's gradients, the worst relative difference of the
    parameters after the steps."""
    same = sorted(plain["grads"]) == sorted(planned["grads"])
    bitwise = same and all(torch.equal(plain["grads"][n], planned["grads"][n])
                           for n in plain["grads"])
    worst = max(((planned["params"][n] - p).norm() / p.norm()).item()
                for n, p in plain["params"].items())
    return {"names": same, "bitwise": bitwise, "worst": worst}


def worker(rank: int, init: str, jobs: dict, results: str, readings: int = READINGS) -> None:
    """Every job of `jobs` (name -> (Job, plan)) on this rank, plain then planned."""
    from remat.fx_passes.measuring.every_thread import track_every_thread

    track_every_thread()  # before the job allocates: the readings see its every free
    world = next(iter(jobs.values()))[0].world
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        out = {}
        for name, (job, plan) in jobs.items():
            mesh = job_mesh(job)
            plain = train_rank(rank, job, mesh, plan, measure=False)
            planned = train_rank(rank, job, mesh, plan, measure=True, readings_wanted=readings)
            out[name] = {**compare(plain, planned), "held": planned["held"],
                         "peak": planned["peak"], "readings": planned["readings"]}
        torch.save(out, f"{results}.{rank}")
    finally:
        dist.destroy_process_group()


def rows(jobs: dict, measured: list) -> list[dict]:
    """One row per job and rank: coordinates, budget, predicted and measured peaks."""
    out = []
    for name, (job, plan) in jobs.items():
        for rank, results in enumerate(measured):
            got = results[name]
            pp = job.coords(rank)[0]
            whole = got["held"] + got["peak"]
            out.append({"job": name, "rank": rank, "coords": job.coords(rank),
                        "budget": plan.budgets[pp], "predicted": plan.peak(pp),
                        "static": plan.static(pp), "allocator": whole,
                        "over": 100 * (whole - plan.peak(pp)) / plan.peak(pp),
                        "recompute": sum(s.recompute_flops for s in plan.stages
                                         if s.rank == pp) * job.microbatches,
                        **{k: got[k] for k in ("held", "bitwise", "worst", "names",
                                               "readings")},
                        "clean": all(end == grads for _, end, grads in got["readings"])})
    return out


def main(argv=None) -> None:
    import tempfile

    import torch.multiprocessing as mp

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--schedules", nargs="+", default=["GPipe", "1F1B"])
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=CONFIG.vocab_size,
                        help="vocabulary size (a large one makes the end-of-step reduction of "
                             "the embedding's and output's gradients the first stage's peak)")
    parser.add_argument("--readings", type=int, default=READINGS,
                        help="profiled steps per rank; the highest peak is taken")
    args = parser.parse_args(argv)
    config = replace(CONFIG, vocab_size=args.vocab)
    jobs, free = {}, None
    for schedule in args.schedules:
        job = Job(pp=args.pp, dp=args.dp, tp=args.tp, schedule=schedule,
                  microbatches=args.microbatches, config=config)
        if schedule not in ("GPipe", "1F1B"):
            parser.error(f"{schedule}: this example runs one stage a rank (GPipe, 1F1B)")
        plan, free = plan_job(job, reuse=free)
        jobs[schedule] = (job, plan)
    world = args.pp * args.dp * args.tp
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(worker, args=(f"file://{tmp}/rendezvous", jobs, f"{tmp}/out", args.readings),
                 nprocs=world, join=True)
        measured = [torch.load(f"{tmp}/out.{r}") for r in range(world)]
    k = lambda b: f"{b:,}"  # noqa: E731
    print(f"Llama hidden {config.hidden}, {config.layers} layers, vocabulary "
          f"{config.vocab_size}, seq {config.seq}, batch 8 a "
          f"replica in {args.microbatches} micro-batches; mesh (pp, dp, tp) = "
          f"({args.pp}, {args.dp}, {args.tp}), {world} gloo ranks; bytes per rank")
    print("| schedule | rank | (pp, dp, tp) | budget | predicted | allocator | over | "
          "held at the start as predicted | recompute MFLOP | grads bitwise equal | "
          "params after 2 steps: worst rel. diff |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, (job, plan) in jobs.items():
        for pp in range(job.pp):
            memory = plan.ranks[pp]
            units = [plan.fsdp_units[s] for s in plan.order.stages_of(pp)
                     if s in plan.fsdp_units]
            end = sum(k.size for k in plan.handoffs[pp] if k.until is None)
            at_reduction = units and reduce_peak(units, job.dp) + end == memory.peak
            print(f"{name}, pipeline rank {pp}: peak "
                  + ("in the end-of-step reduction" if at_reduction
                     else f"at {memory.peak_action}")
                  + (f"; FSDP2: gathered parameters {sum(u.gathered for u in units):,} B, "
                     f"the reduction's peak {reduce_peak(units, job.dp):,} B above the state"
                     if units else ""))
    for r in rows(jobs, measured):
        print(f"| {r['job']} | {r['rank']} | {r['coords']} | {k(r['budget'])} | "
              f"{k(r['predicted'])} | {k(r['allocator'])} | {r['over']:+.2f} % | "
              f"{'yes' if r['held'] == r['static'] else k(r['held'] - r['static'])} | "
              f"{r['recompute'] / 1e6:.2f} | {'yes' if r['bitwise'] else 'no'} | "
              f"{r['worst']:.1e} |")
    for r in rows(jobs, measured):  # readings that disagree, or left more than gradients
        if len(set(r["readings"])) > 1 or not r["clean"]:
            print(f"{r['job']} rank {r['rank']}: readings (peak, end, gradients) "
                  + ", ".join(f"({p:,}, {e:,}, {g:,})" for p, e, g in r["readings"]))


if __name__ == "__main__":
    main()
