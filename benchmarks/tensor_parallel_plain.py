"""Tensor-parallel plans against the same job without remat, on 4 gloo ranks (CPU): TP and TP+SP
on 2 ranks (two pairs), FSDP2 x TP and FSDP2 x TP+SP on 4.

    python benchmarks/tensor_parallel_plain.py [--model gpt|llama] [--share 0.6]

gpt: a GPT-2-style decoder defined here (learned positions, LayerNorm, biases, GELU MLP,
dropout 0.1; hidden 64, 4 heads, 2 layers, sequence 32, vocabulary 128, batch 4); llama: the
tests' Llama (examples/llama.py's LLAMA_TEST, batch 2). Per job and rank, in bytes:
- plain: the job without remat, measured: what the rank holds when the step starts (its
  shards, AdamW's moments, the batch) plus the allocator's peak of a step above it (the least
  of three readings);
- no checkpoint: remat's prediction of that step (its plan at an unbounded budget);
- policies only: what the eager planner's policies reach at no recompute (every block's
  selective policy caching all it needs), the top of their range;
- the budget: `--share` of the way from remat's least (BudgetError.smallest) to that top;
- at that budget, predicted and measured: the planner's selective policies alone (as remat
  planned before no checkpoint was a candidate) and remat's plan, with what each recomputes
  (MFLOP) and sends again (bytes).
Nothing reserved, no margin. A few minutes on 2 busy cores.
"""
from __future__ import annotations

import argparse
import copy
import gc
import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import remat  # noqa: E402
from remat.solvers import SolverOptions  # noqa: E402

DP, TP = 2, 2
WORLD = DP * TP
JOBS = {"tp": (False, 1, 0), "tp+sp": (True, 1, 0), "fsdp2 x tp": (False, DP, 3),
        "fsdp2 x tp+sp": (True, DP, 3)}  # job -> (sequence parallel, dp, zero stage)


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 128
    seq: int = 32
    hidden: int = 64
    heads: int = 4
    layers: int = 2
    dropout: float = 0.1


class Attention(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.head_dim, self.p = c.hidden // c.heads, c.dropout
        self.q, self.k, self.v, self.proj = (nn.Linear(c.hidden, c.hidden) for _ in range(4))

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (w(x).view(b, s, -1, self.head_dim).transpose(1, 2)
                   for w in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.p if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(b, s, -1))  # -1: this rank's heads


class MLP(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.fc, self.proj = nn.Linear(c.hidden, 4 * c.hidden), nn.Linear(4 * c.hidden, c.hidden)

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(c.hidden), Attention(c)
        self.ln_2, self.mlp = nn.LayerNorm(c.hidden), MLP(c)
        self.drop = nn.Dropout(c.dropout)

    def forward(self, x):
        x = x + self.drop(self.attn(self.ln_1(x)))
        return x + self.drop(self.mlp(self.ln_2(x)))


class Embed(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(c.vocab, c.hidden), nn.Embedding(c.seq, c.hidden)
        self.drop = nn.Dropout(c.dropout)

    def forward(self, tokens):
        return self.drop(self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1])))


class GPT(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.embed = Embed(c)
        self.layers = nn.ModuleList(Block(c) for _ in range(c.layers))
        self.ln_f = nn.LayerNorm(c.hidden)
        self.head = nn.Linear(c.hidden, c.vocab, bias=False)

    def forward(self, tokens, targets):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def parallelize_gpt(model: GPT, mesh, sequence_parallel: bool) -> GPT:
    """Megatron's layout: q, k, v and fc column-wise, the projections row-wise, the head
    column-wise with its logits gathered; with `sequence_parallel` the embeddings' output cut
    along the sequence, the norms sharded there, gathered before the attention and the MLP and
    reduce-scattered after them."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                                   PrepareModuleOutput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    residual = Shard(1) if sequence_parallel else Replicate()
    top = {"head": ColwiseParallel(input_layouts=residual, output_layouts=Replicate())}
    if sequence_parallel:
        top["embed"] = PrepareModuleOutput(output_layouts=Replicate(),
                                           desired_output_layouts=Shard(1))
        top["ln_f"] = SequenceParallel()
    parallelize_module(model, mesh, top)
    for layer in model.layers:
        plan = {"attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(),
                "attn.v": ColwiseParallel(), "attn.proj": RowwiseParallel(output_layouts=residual),
                "mlp.fc": ColwiseParallel(), "mlp.proj": RowwiseParallel(output_layouts=residual)}
        if sequence_parallel:
            gather = PrepareModuleInput(input_layouts=(Shard(1),),
                                        desired_input_layouts=(Replicate(),))
            plan.update({"ln_1": SequenceParallel(), "ln_2": SequenceParallel(),
                         "attn": gather, "mlp": copy.deepcopy(gather)})
        parallelize_module(layer, mesh, plan)
    return model


def build(name: str):
    """(model, (tokens, targets), parallelize, vocabulary, sequence)."""
    if name == "gpt":
        c = GPTConfig()
        torch.manual_seed(0)
        model = GPT(c).train()
        g = torch.Generator().manual_seed(1)
        data = tuple(torch.randint(0, c.vocab, (4, c.seq), generator=g) for _ in range(2))
        return model, data, parallelize_gpt, c.vocab, c.seq
    from examples.llama import LLAMA_TEST, llama
    from examples.llama_tensor_parallel import parallelize_llama

    model, data = llama(LLAMA_TEST, batch=2, data_seed=1)
    return model, data, parallelize_llama, LLAMA_TEST.vocab_size, LLAMA_TEST.seq


def _mesh():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))


def plan_jobs(name: str, share: float) -> dict:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from remat.planner.parallel.tensor_parallel import (TensorParallelPlan,
                                                        plan_tensor_parallel,
                                                        prepare_tensor_parallel)
    from remat.planner.plans.eager_plan import plan_eager_mode

    out = {}
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
    try:
        mesh = _mesh()
        for job, (sequence, dp, zero) in JOBS.items():
            model, inputs, parallelize, _, _ = build(name)
            parallelize(model, mesh["tp"], sequence)
            training = remat.Training(reserve=0, fragmentation=0.0, tensor_parallel=TP,
                                      sequence_parallel=sequence, data_parallel=dp,
                                      zero_stage=zero)
            prepared = prepare_tensor_parallel(model, inputs, training=training)
            options = SolverOptions(relative_gap=0.01, time_limit=30)
            args = dict(example_inputs=inputs, training=training, prepared=prepared,
                        solver_options=options)

            def policies(**budget):  # the selective policies alone
                plan = plan_eager_mode(model, prepared, target="h100", solver="optimal",
                                       solver_options=options, blocks=None,
                                       example_inputs=inputs, **budget)
                return TensorParallelPlan(plan, {})

            none = plan_tensor_parallel(model, activation_budget=10**12, **args)
            top = policies(budget=None, activation_budget=10**12).peak
            try:
                plan_tensor_parallel(model, budget=1, **args)
            except remat.BudgetError as e:
                least = e.smallest
            budget = int(least + share * (top - least))
            plans = {"policies only": policies(budget=budget, activation_budget=None),
                     "remat": plan_tensor_parallel(model, budget=budget, **args)}
            out[job] = {"none": none.peak, "top": top, "least": least, "budget": budget,
                        "plans": {k: (p.peak, p.recompute_flops, p.recommunicated,
                                      p.block_policies) for k, p in plans.items()}}
    finally:
        dist.destroy_process_group()
    return out


def _fsdp(model, mesh):
    from torch.distributed.fsdp import fully_shard

    layers = list(model.layers)
    for layer in layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    for a, b in zip(layers, layers[1:]):  # one block ahead both ways: Training(prefetch=1)
        a.set_modules_to_forward_prefetch([b])
        b.set_modules_to_backward_prefetch([a])
    return model


def whole_step_peak(model, rank: int, vocab: int, seq: int, batch: int) -> int:
    from remat.fx_passes.measuring.allocator import allocator_peak
    from remat.fx_passes.measuring.storage import distinct_storage_bytes

    local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(100 + rank // TP)  # a TP group's ranks: the same data
    tokens, targets = (torch.randint(0, vocab, (batch, seq), generator=g) for _ in range(2))
    for _ in range(2):
        model(tokens, targets).backward()
        opt.step()
        opt.zero_grad()
    held = (distinct_storage_bytes(local(p) for p in model.parameters())
            + distinct_storage_bytes(local(t) for s in opt.state.values() for t in s.values()
                                     if t.dim())
            + distinct_storage_bytes([tokens, targets]))
    peaks = []
    for _ in range(3):
        gc.collect()
        dist.barrier()
        torch.manual_seed(7)
        peaks.append(allocator_peak(lambda: model(tokens, targets).backward()))
        opt.zero_grad()
    return held + min(peaks)


def worker(rank: int, init: str, name: str, planned: dict, results: str) -> None:
    from remat.fx_passes.eager.apply import apply_eager

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
    try:
        torch.set_num_threads(1)
        mesh = _mesh()
        out = {}
        for job, (sequence, _, zero) in JOBS.items():
            base, data, parallelize, vocab, seq = build(name)
            wrap = (lambda m: _fsdp(m, mesh)) if zero else (lambda m: m)
            measure = lambda m: whole_step_peak(wrap(m), rank, vocab, seq,  # noqa: E731
                                                data[0].shape[0])
            out[job] = {"plain": measure(parallelize(copy.deepcopy(base), mesh["tp"], sequence))}
            for kind, (*_, policies) in planned[job]["plans"].items():
                model = parallelize(copy.deepcopy(base), mesh["tp"], sequence)
                out[job][kind] = measure(apply_eager(model, policies))
        torch.save(out, f"{results}.{rank}")
    finally:
        dist.destroy_process_group()


def main(argv=None) -> None:
    from tests.ranks import rank_results

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("gpt", "llama"), default="gpt")
    parser.add_argument("--share", type=float, default=0.6)
    args = parser.parse_args(argv)
    planned = plan_jobs(args.model, args.share)
    measured = rank_results(worker, (args.model, planned), WORLD, seconds=1200)
    print(f"{args.model}, budget {args.share:.0%} of the way from remat's least to its policies' "
          "top; bytes per rank (predicted / measured), recompute MFLOP, re-sent bytes")
    print("| job | rank | plain | no checkpoint predicted | policies' top | least | budget "
          "| policies only | remat |")
    print("|---|---|---|---|---|---|---|---|---|")
    for job, p in planned.items():
        for rank, m in enumerate(measured):
            cells = []
            for kind, (peak, flops, resent, _) in p["plans"].items():
                cells.append(f"{peak:,} / {m[job][kind]:,} ({m[job][kind] - m[job]['plain']:+,} "
                             f"vs plain), {flops / 1e6:.2f}, {resent:,}")
            print(f"| {job} | {rank} | {m[job]['plain']:,} | {p['none']:,} | {p['top']:,} | "
                  f"{p['least']:,} | {p['budget']:,} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
