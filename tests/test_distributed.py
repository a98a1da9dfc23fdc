"""An eager plan under FSDP2 and DDP: CPU, gloo, 2 ranks, a tiny Llama with dropout.

The plan is made once on the unsharded model with `Training(data_parallel=2, zero_stage=3)`,
its block policies are sent to the ranks, applied before `fully_shard` (or DDP), and the
parameters after two AdamW steps must equal the same job without remat."""
from __future__ import annotations

import copy
import os
import tempfile
from functools import partial

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import remat
from remat.fx_passes.eager_policy import apply_eager
from remat.planner.eager_plan import plan_eager_mode
from remat.planner.optimize import prepare
from remat.solvers import SolverOptions
from tests.llama_tiny import TinyLlamaConfig, tiny_llama

CONFIG = TinyLlamaConfig(hidden=32, mlp=88, seq=16, dropout=0.1)
WORLD = 2
STEPS = 2


def _batch(rank: int, step: int):
    g = torch.Generator().manual_seed(100 * rank + step)
    tokens = torch.randint(0, CONFIG.vocab, (2, CONFIG.seq), generator=g)
    return tokens, torch.randint(0, CONFIG.vocab, (2, CONFIG.seq), generator=g)


def _train(model, rank: int, wrap) -> dict[str, torch.Tensor]:
    model = wrap(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(STEPS):
        torch.manual_seed(1000 * rank + step)  # the same dropout masks in both jobs
        model(*_batch(rank, step)).backward()
        opt.step()
        opt.zero_grad()
    return {n.removeprefix("module."): (p.full_tensor() if hasattr(p, "full_tensor") else p)
            .detach().clone() for n, p in model.named_parameters()}


def _fsdp(model):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (WORLD,))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _ddp(model):
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model)


def _worker(rank: int, init: str, policies, results: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
    try:
        torch.set_num_threads(1)
        out = {}
        for kind, wrap in (("fsdp", _fsdp), ("ddp", _ddp)):
            base, _ = tiny_llama(CONFIG)
            plain = _train(copy.deepcopy(base), rank, wrap)
            planned = _train(apply_eager(copy.deepcopy(base), policies), rank, wrap)
            out[kind] = {
                "worst": max(((planned[n] - plain[n]).norm() / plain[n].norm()).item()
                             for n in plain),
                "moved": max(((plain[n] - p).norm() / p.norm()).item()
                             for n, p in base.named_parameters()),
                "names": sorted(plain) == sorted(planned)}
        torch.save(out, f"{results}.{rank}")
    finally:
        dist.destroy_process_group()


def _policies():
    model, inputs = tiny_llama(CONFIG)
    training = remat.Training(data_parallel=WORLD, zero_stage=3)
    prepared = prepare(model, inputs, training=training)
    plan = partial(plan_eager_mode, model, prepared, budget=None, target="h100",
                   solver="optimal", solver_options=SolverOptions(time_limit=5), blocks=None,
                   example_inputs=inputs)
    # A budget between the least eager peak and saving everything: the plan recomputes.
    budget = int(0.8 * plan(activation_budget=10**9).activation_peak)
    planned = plan(activation_budget=budget)
    assert planned.recompute_flops > 0
    assert any(p.cache for p in planned.block_policies.values())
    return planned.block_policies


def test_eager_plan_trains_like_plain_pytorch_under_fsdp2_and_ddp():
    policies = _policies()
    with tempfile.TemporaryDirectory() as tmp:
        results = os.path.join(tmp, "result")
        mp.spawn(_worker, args=(f"file://{tmp}/rendezvous", policies, results),
                 nprocs=WORLD, join=True)
        for rank in range(WORLD):
            for kind, out in torch.load(f"{results}.{rank}").items():
                assert out["names"], kind
                assert out["moved"] > 1e-3, kind  # the optimizer really stepped
                assert out["worst"] <= 1e-5, (kind, rank, out)
