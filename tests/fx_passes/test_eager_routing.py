"""A routing decision (``topk``) in an eager block: every policy caches it (a recomputation
must not route again), and eager PyTorch frees it as it frees any cached value, when the
recomputation's variables and the autograd nodes that read it let go, not when the block's
backward ends. With nothing else cached (per-block checkpointing), the eager prediction is
the allocator's peak to the byte (Qwen3-MoE's router: its [91, 2] float32 top-k weights, 728
bytes, above it before)."""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import torch
import torch.nn as nn

import remat
from examples.hf_zoo import activation_peak, training_step
from remat.fx_passes.eager.apply import apply_eager
from remat.fx_passes.eager.block_policy import with_cache
from remat.solvers.timeline.eager import eager_schedule


class Routed(nn.Module):
    """Qwen3-MoE's router, unnormalized: the top-k weights scale the expert's output."""

    def __init__(self, d=32, experts=4):
        super().__init__()
        self.gate, self.up, self.down = nn.Linear(d, experts), nn.Linear(d, 96), nn.Linear(96, d)

    def forward(self, x):
        weights, _ = torch.softmax(self.gate(x), dim=-1).topk(2, dim=-1)
        return x + self.down(torch.relu(self.up(x))) * weights.sum(-1, keepdim=True)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(Routed() for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.square().mean()


def test_per_block_checkpointing_of_a_routed_block_is_predicted_to_the_byte():
    torch.manual_seed(0)
    model, x = Net(), torch.randn(13, 7, 32)
    plan = remat.optimize(model, activation_budget=10**9, example_inputs=(x,),
                          execution="eager")
    assert all(pol.keep for pol in plan.block_policies.values())  # the top-k, kept
    per_block = eager_schedule(plan.eager_problem, plan.structure, ())
    apply_eager(model, {p: dataclasses.replace(with_cache(pol, frozenset()), training=True)
                        for p, pol in plan.policies.items()})
    step = training_step(lambda: SimpleNamespace(loss=model(x)), {}, seed=0)
    step()
    measured = activation_peak(step, model)
    assert measured == per_block.peak - plan.prepared.graph_gradients
