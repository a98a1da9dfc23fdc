"""Replicated capture: three traced blocks, the middle one copied, must give the full trace's
Problem op for op (names included); stacks that are not uniform are captured whole, saying so."""
import logging
from dataclasses import replace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from examples.llama import LLAMA_TINY, llama
from remat.fx_passes import capture, lower
from remat.fx_passes.tracing.replicate import (ReplicatedCapture, capture_replicated,
                                              find_periodic_stack, find_stack, stack_period)
from tests import models


def _assert_same_step(model, inputs, *, replicated: bool):
    full = capture(model, inputs)
    rep = capture_replicated(model, inputs)
    assert isinstance(rep, ReplicatedCapture) is replicated
    expected, got = lower(full), lower(rep)
    assert len(got) == len(expected)
    for i, (a, b) in enumerate(zip(expected.ops, got.ops)):
        assert a == b, f"op {i} differs:\n  full       {a}\n  replicated {b}"
    assert got.source == expected.source
    for field in ("params", "buffers", "user_inputs", "tangents", "mutated_inputs",
                  "num_fwd_outputs", "param_count", "param_bytes", "dtype"):
        assert getattr(rep, field) == getattr(full, field), field
    assert [p.name for p in rep.placeholders] == [p.name for p in full.placeholders]
    return rep


def test_llama_stack_replicated_equals_full_trace():
    model, inputs = llama(replace(LLAMA_TINY, layers=5, seq=16), batch=2)
    rep = _assert_same_step(model, inputs, replicated=True)
    assert (rep.block_path, rep.blocks, rep.traced_blocks) == ("layers", 5, 3)
    # the model's own stack is back in place
    assert len(model.layers) == 5


def test_gpt2_stack_with_dropout_replicated_equals_full_trace():
    # nanoGPT: tied embeddings, LayerNorm with bias, dropout (generator snapshots per block)
    model, inputs = models.gpt(models.GPTConfig(n_layer=4, block_size=16), batch=2)
    rep = _assert_same_step(model, inputs, replicated=True)
    assert (rep.block_path, rep.blocks) == ("h", 4)
    assert any("rng_state" in n.name for n in rep.graph.nodes)


def test_unet_without_a_stack_is_captured_whole(caplog):
    model, inputs = models.unet(batch=1, size=16)
    assert find_stack(model) is None
    with caplog.at_level(logging.INFO, logger="remat.fx_passes.tracing.replicate"):
        _assert_same_step(model, inputs, replicated=False)
    assert "no ModuleList/Sequential" in caplog.text


class _Level(nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3, padding=1)

    def forward(self, x):
        return F.relu(self.conv(x))


class _FlatUNet(nn.Module):
    """Equal encoder blocks and equal decoder blocks, each decoder block reading the skip of a
    different encoder block: stacks that look uniform but whose blocks read other values."""

    def __init__(self, levels=4, c=4):
        super().__init__()
        self.stem = nn.Conv2d(1, c, 1)
        self.down = nn.ModuleList(_Level(c, c) for _ in range(levels))
        self.up = nn.ModuleList(_Level(2 * c, c) for _ in range(levels))

    def forward(self, x, target):
        x = self.stem(x)
        skips = []
        for block in self.down:
            x = block(x)
            skips.append(x)
        for block, skip in zip(self.up, reversed(skips)):
            x = block(torch.cat([x, skip], dim=1))
        return F.mse_loss(x.mean(1, keepdim=True), target)


def test_unet_with_equal_blocks_and_skips_is_not_replicated(caplog):
    torch.manual_seed(0)
    model = _FlatUNet()
    inputs = (torch.randn(1, 1, 8, 8), torch.randn(1, 1, 8, 8))
    assert find_stack(model)[0] == "up"
    with caplog.at_level(logging.INFO, logger="remat.fx_passes.tracing.replicate"):
        _assert_same_step(model, inputs, replicated=False)
    assert "not interchangeable" in caplog.text


class _Scaled(nn.Module):
    def __init__(self, scale, layer_idx):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.scale, self.layer_idx = scale, layer_idx


def test_find_stack_compares_attributes_but_not_layer_index():
    same = nn.Module()
    same.blocks = nn.ModuleList(_Scaled(1.0, i) for i in range(4))
    assert find_stack(same)[0] == "blocks"
    differ = nn.Module()
    differ.blocks = nn.ModuleList(_Scaled(float(i), i) for i in range(4))
    assert find_stack(differ) is None
    short = nn.Module()
    short.blocks = nn.ModuleList(_Scaled(1.0, i) for i in range(3))
    assert find_stack(short) is None  # three blocks: nothing to gain


def test_a_stack_equal_with_a_period_is_found_with_its_period():
    alternating = nn.Module()
    alternating.blocks = nn.ModuleList(_Scaled(float(i % 2), i) for i in range(8))
    path, _, period = find_periodic_stack(alternating)
    assert (path, period) == ("blocks", 2)
    assert stack_period(list("abcabcabcabc")) == 3
    assert stack_period(list("ababab")) is None  # three groups: nothing to gain
    assert stack_period(list("ababa")) is None  # the period does not divide the count
    assert stack_period(list("aaaab")) is None


def test_gemma2_alternating_layers_replicated_by_pairs_equals_full_trace():
    """Gemma-2's layers alternate sliding-window and full attention: each pair is a block.
    Its mask building leaves names that dead-code elimination removed (``arange_2``), which
    the replicated graph skips as the full trace does."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
        vocab_size=99, hidden_size=32, intermediate_size=37, num_hidden_layers=8,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=4,
        max_position_embeddings=64, use_cache=False)).train()
    ids = torch.randint(0, 99, (2, 12))
    full = capture(model, (), example_kwargs={"input_ids": ids, "labels": ids})
    assert any(n.name == "arange_3" for n in full.graph.nodes) and \
        not any(n.name == "arange_2" for n in full.graph.nodes)
    rep = capture_replicated(model, (), example_kwargs={"input_ids": ids, "labels": ids})
    assert isinstance(rep, ReplicatedCapture)
    assert (rep.block_path, rep.blocks, rep.traced_blocks) == ("model.layers", 8, 6)
    expected, got = lower(full), lower(rep)
    assert got.ops == expected.ops
    assert [n.name for n in rep.graph.nodes] == [n.name for n in full.graph.nodes]
    assert (rep.params, rep.buffers, rep.param_count) == \
        (full.params, full.buffers, full.param_count)


def test_plan_of_a_replicated_capture_runs_on_the_full_graph(caplog):
    from remat.planner.plans.plan import plan_prepared
    from remat.planner.plans.prepare import prepare
    from remat.planner.job.training import Training

    model, inputs = llama(replace(LLAMA_TINY, layers=4, seq=16), batch=2)
    prepared = prepare(model, inputs, training=Training(reserve=0, fragmentation=0.0),
                       replicate=True)
    assert isinstance(prepared.captured, ReplicatedCapture)
    peaks = sorted(s.peak for s in prepared.baselines.values())
    plan = plan_prepared(model, prepared, budget=None, activation_budget=peaks[-1],
                         target="h100")
    with caplog.at_level(logging.WARNING, logger="remat.planner.optimize"):
        module = plan.module
    assert "planned again" in caplog.text
    loss = module(*inputs)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    expected = model(*inputs)
    expected.backward()
    torch.testing.assert_close(loss, expected)
    for n, p in model.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, msg=n)


def test_prepare_replicates_a_model_on_meta_by_default():
    from remat.planner.plans.prepare import prepare

    model, inputs = llama(replace(LLAMA_TINY, layers=4, seq=16), batch=2, device="meta")
    replicated = prepare(model, inputs)
    assert isinstance(replicated.captured, ReplicatedCapture)
    full = prepare(model, inputs, replicate=False)
    assert not isinstance(full.captured, ReplicatedCapture)
    assert replicated.problem.ops == full.problem.ops
    assert replicated.state == full.state
