"""Eager plans never cache a tensor that the block later overwrites in place, nor an in-place
op (checkpoint refuses the first at backward; the second would skip its write when
recomputed). The three patterns come from transformers: Mixtral's router (`topk`, then `/=`),
DeepSeek-V3's `expand_kv` (`copy_` into slices of a `new_empty` buffer), T5's position buckets
(an integer tensor, then `+=`). Judged by eager PyTorch's gradients, at a budget generous
enough that the planner caches everything it may."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import remat
from remat.fx_passes.eager.probe import probe


class Router(nn.Module):  # Mixtral's top-k router, normalized in place
    def __init__(self, d=32):
        super().__init__()
        self.gate, self.up, self.down = nn.Linear(d, 4), nn.Linear(d, 64), nn.Linear(64, d)

    def forward(self, x):
        top, _ = torch.softmax(self.gate(x), dim=-1).topk(2, dim=-1)
        top /= top.sum(dim=-1, keepdim=True)
        return x + self.down(torch.relu(self.up(x))) * top.sum(-1, keepdim=True)


class ExpandKV(nn.Module):  # DeepSeek-V3's expand_kv: a buffer filled through slices
    def __init__(self, d=32):
        super().__init__()
        self.a, self.b, self.o = nn.Linear(d, 64), nn.Linear(d, 32), nn.Linear(96, d)

    def forward(self, x):
        kn, kr = self.a(x), self.b(x)
        k = kn.new_empty(*kn.shape[:-1], 96)
        k[..., :64].copy_(kn)
        k[..., 64:].copy_(kr)
        return x + self.o(torch.relu(k))


class Buckets(nn.Module):  # T5's relative position buckets: integers, then `+=`
    def __init__(self, d=32, seq=7):
        super().__init__()
        self.bias, self.up = nn.Embedding(8, 1), nn.Linear(d, d)
        self.seq = seq

    def forward(self, x):
        position = torch.arange(self.seq)
        relative = position[None, :] - position[:, None]
        buckets = (relative > 0).to(torch.long) * 4
        buckets += torch.where(relative.abs() < 2, relative.abs(), torch.full_like(relative, 3))
        scores = torch.softmax(x @ x.transpose(-1, -2) + self.bias(buckets).squeeze(-1), -1)
        return x + self.up(scores @ x)


class Net(nn.Module):
    def __init__(self, block):
        super().__init__()
        self.layers = nn.ModuleList(block() for _ in range(2))

    def forward(self, x, y):
        for layer in self.layers:
            x = layer(x)
        return ((x - y) ** 2).mean()


def _inputs():
    g = torch.Generator().manual_seed(3)
    return torch.randn(13, 7, 32, generator=g), torch.randn(13, 7, 32, generator=g)


@pytest.mark.parametrize("block", [Router, ExpandKV, Buckets])
def test_eager_plan_of_a_block_that_writes_in_place_trains_like_eager(block):
    torch.manual_seed(0)
    model = Net(block)
    x, y = _inputs()
    reference = copy.deepcopy(model)
    reference(x, y).backward()
    plan = remat.optimize(model, activation_budget=10**9, example_inputs=(x, y),
                          execution="eager")
    policies = plan.block_policies
    assert any(pol.cache for pol in policies.values())  # the planner did cache
    model = plan.apply(model)
    model(x, y).backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p.grad, q.grad), name


def test_probe_names_the_tensors_overwritten_and_the_writers():
    torch.manual_seed(0)
    model = Net(ExpandKV)
    x, y = _inputs()
    observed = probe(model, (x, y), ["layers.0"])["layers.0"]
    ops, mutated = observed.ops, observed.mutated
    empty = ops.index("aten.new_empty.default")
    copies = [k for k, op in enumerate(ops) if op == "aten.copy_.default"]
    slices = [k for k, op in enumerate(ops) if op == "aten.slice.Tensor"]
    assert len(copies) == 2
    assert {empty, *copies, *slices} <= mutated  # the buffer, its slices, the writes
    assert not {k for k, op in enumerate(ops) if op == "aten.addmm.default"} & mutated


def test_probe_gives_the_bytes_of_the_tensors_ops_make_in_storages_of_their_own():
    """`Observed.nbytes`, which the eager problem takes for the graph's: a fresh tensor's
    storage; nothing for a view or an in-place write (their bytes are another op's)."""
    torch.manual_seed(0)
    model = Net(ExpandKV)
    x, y = _inputs()
    observed = probe(model, (x, y), ["layers.0"])["layers.0"]
    made = dict(zip(observed.ops, observed.nbytes))
    assert len(observed.nbytes) == len(observed.ops)
    assert made["aten.new_empty.default"] == 13 * 7 * 96 * 4
    assert made["aten.relu.default"] == 13 * 7 * 96 * 4
    assert {observed.nbytes[k] for k, op in enumerate(observed.ops)
            if op in ("aten.copy_.default", "aten.slice.Tensor", "aten.view.default",
                      "aten.t.default")} == {0}
