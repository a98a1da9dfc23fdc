"""Per-block compile under FSDP2 (what torchtitan does: each block compiled, then
`fully_shard`), with remat's partitioner inside each block: CPU, gloo, 2 ranks, a tiny Llama
with dropout. Parameters after two AdamW steps equal the same job without remat."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import remat
from remat.fx_passes.compiled.block_compile import compile_model_blocks
from remat.planner.plans.block_compile import block_plans
from remat.solvers import SolverOptions
from examples.llama import tiny_llama
from tests.ranks import rank_results
# The same model, batches, seeds and training loop as the eager plan's FSDP2 test.
from tests.planner.test_distributed import CONFIG, WORLD, _fsdp, _train


def _worker(rank: int, init: str, plans, results: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
    try:
        torch.set_num_threads(1)
        base, _ = tiny_llama(CONFIG)
        plain, _ = _train(copy.deepcopy(base), rank, _fsdp)
        compiled = compile_model_blocks(copy.deepcopy(base), plans)
        planned, _ = _train(compiled, rank, _fsdp)
        torch.save({
            "worst": max(((planned[n] - plain[n]).norm() / plain[n].norm()).item()
                         for n in plain),
            "moved": max(((plain[n] - p).norm() / p.norm()).item()
                         for n, p in base.named_parameters()),
            "recomputed": {p: [len(x.recomputed) for x in made]
                           for p, made in compiled.remat_partitions.items()},
        }, f"{results}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def plan():
    model, inputs = tiny_llama(CONFIG)
    training = remat.Training(data_parallel=WORLD, zero_stage=3)
    options = SolverOptions(time_limit=5)
    whole = remat.optimize(model, activation_budget=10**9, example_inputs=inputs,
                           training=training, solver_options=options, execution="eager")
    # Between the least eager peak and saving everything: the plan recomputes.
    return remat.optimize(model, activation_budget=int(0.8 * whole.activation_peak),
                          example_inputs=inputs, training=training, solver_options=options,
                          execution="eager")


def test_compiled_blocks_train_like_plain_pytorch_under_fsdp2(plan):
    plans = block_plans(plan)
    assert sorted(plans) == ["layers.0", "layers.1"]
    for rank, out in enumerate(rank_results(_worker, (plans,), WORLD, seconds=600)):
        assert out["moved"] > 1e-3  # the optimizer really stepped
        assert out["worst"] <= 1e-5, (rank, out)
        # remat's partitioner compiled each block once, and recomputes in some.
        assert sorted(out["recomputed"]) == sorted(plans), out
        assert all(len(r) == 1 for r in out["recomputed"].values()), out
        assert sum(r[0] for r in out["recomputed"].values()) > 0, out


def test_a_block_whose_ops_differ_from_the_plan_is_refused(plan):
    """The plan lacks the block's first op, whose value the backward needs: its decision
    would be a guess."""
    model, inputs = tiny_llama(CONFIG)
    plans = block_plans(plan)
    first = plans["layers.0"]
    plans["layers.0"] = type(first)(first.path, first.targets[1:],
                                    frozenset(k - 1 for k in first.kept if k))
    compile_model_blocks(model, plans)
    with pytest.raises(remat.RematError,
                       match=r"block 'layers.0' compiled to \d+ forward ops .*; op 0 is "):
        model(*inputs).backward()


def test_each_block_compiles_on_its_own_and_an_uncompiled_run_is_an_error(plan):
    torch._dynamo.reset()  # the recompile counts start from here, whatever ran before
    model, inputs = tiny_llama(CONFIG)
    remat.compile_blocks(plan, model)  # the public name
    with torch._dynamo.config.patch(recompile_limit=1):
        # Every block runs the same forward code: each is compiled all the same, once.
        model(*inputs).backward()
        assert {p: len(made) for p, made in model.remat_partitions.items()} == \
            {"layers.0": 1, "layers.1": 1}
        # Another sequence length needs a recompilation, past the limit: dynamo would run
        # the block's Python code, without the plan.
        shorter = tuple(x[:, : CONFIG.seq // 2] for x in inputs)
        with pytest.raises(remat.RematError, match="'layers.0' ran without remat's partitioner"):
            model(*shorter).backward()


def test_hf_blocks_compiled_alone_follow_the_plan_where_their_ops_differ(caplog):
    """Transformers builds GPT-2's attention mask outside the blocks: traced whole, the blocks
    see a mask; compiled alone, None, and run fused attention without the mask's ops. The
    plan's decisions follow the ops matched by target, and the step trains as eager does."""
    pytest.importorskip("transformers")
    from tests.gradients import REORDERED_SUMS
    from tests.models import gpt2_hf

    model, (ids,) = gpt2_hf(batch=2, seq=32)
    model.model.config.use_cache = False
    for module in model.modules():  # one step each, compared: no random masks
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    eager = copy.deepcopy(model)
    save_all = remat.optimize(model, activation_budget=10**12, example_inputs=(ids,),
                              execution="eager", solver="save_all").activation_peak
    plan = remat.optimize(model, activation_budget=save_all * 3 // 4, example_inputs=(ids,),
                          execution="eager", solver_options=SolverOptions(time_limit=10))
    with caplog.at_level("WARNING", logger="remat.fx_passes.compiled.block_compile"):
        compiled = plan.compile_blocks(model)
        compiled(ids).loss.backward()
    assert "compiled to 48 forward ops where the plan has 51" in caplog.text
    assert any(len(p.recomputed) for made in compiled.remat_partitions.values() for p in made)
    eager(ids).loss.backward()
    for (name, a), b in zip(eager.named_parameters(), model.parameters()):
        scale = max(a.grad.abs().max().item(), 1e-30)
        assert (a.grad - b.grad).abs().max().item() <= REORDERED_SUMS * scale, name


_S, _D = 8, 16


class _MaskedBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(_D, _D)

    def forward(self, x, mask=None):
        h = self.lin(x)
        scores = h @ h.transpose(-1, -2)
        if mask is None:  # as SDPA's is_causal: the block makes its causal mask itself
            mask = torch.ones(_S, _S, dtype=torch.bool).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
        return torch.tanh(torch.softmax(scores, -1) @ h) + x


class _MaskOutside(torch.nn.Module):
    """As transformers' masking utilities: the mask is built outside the blocks when traced,
    and None when run eagerly (an all-ones padding mask), as around blocks compiled alone."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(_MaskedBlock() for _ in range(2))

    def forward(self, x):
        mask = (torch.ones(_S, _S, dtype=torch.bool).tril() if torch.compiler.is_compiling()
                else None)
        for block in self.blocks:
            x = block(x, mask)
        return x.pow(2).sum()


def _compiled_blocks_train_as_eager(model, x, fraction: float, caplog) -> str:
    """`model` planned in eager mode at `fraction` of its peak saving everything, its blocks
    compiled by `plan.compile_blocks`, one step: some block recomputes, and the gradients
    equal eager PyTorch's. Returns compile_blocks' warnings."""
    options = SolverOptions(time_limit=5)
    whole = remat.optimize(model, activation_budget=10**9, example_inputs=(x,),
                           execution="eager", solver_options=options).activation_peak
    plan = remat.optimize(model, activation_budget=int(fraction * whole), example_inputs=(x,),
                          execution="eager", solver_options=options)
    eager = copy.deepcopy(model)
    with caplog.at_level("WARNING", logger="remat.fx_passes.compiled.block_compile"):
        compiled = plan.compile_blocks(model)
        compiled(x).backward()
    assert any(len(p.recomputed) for made in compiled.remat_partitions.values() for p in made)
    eager(x).backward()
    for (name, a), b in zip(eager.named_parameters(), model.parameters()):
        assert torch.equal(a.grad, b.grad), name
    return caplog.text


def test_a_block_that_builds_its_own_mask_follows_the_plan(caplog):
    """The compiled block makes a causal mask (ones, tril) that the plan's capture made
    outside it: those ops, computed from no input of the block, are not kept, and every other
    op follows the plan. The gradients equal eager PyTorch's."""
    torch.manual_seed(0)
    warnings = _compiled_blocks_train_as_eager(_MaskOutside(), torch.randn(4, _S, _D), 0.7,
                                               caplog)
    assert "3 computed from no input of the block (from op 11, aten.ones.default)" in warnings

class _NormBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(4, 4, 3, padding=1)
        self.norm = torch.nn.BatchNorm2d(4)

    def forward(self, x):
        return torch.relu(self.norm(self.conv(x))) + x


class _NormNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.Sequential(_NormBlock(), _NormBlock())

    def forward(self, x):
        return self.blocks(x).pow(2).sum()


def test_a_block_with_batchnorm_keeps_what_reads_its_running_statistics():
    """A compiled block copies BatchNorm's new running statistics into the buffers as its
    forward returns: recomputing the norm in the backward would read the new ones (autograd's
    version check fails). Asked to keep only the convolution and the ReLU, the block keeps
    the norm too. Gradients and running statistics equal eager PyTorch's."""
    torch.manual_seed(0)
    model, x = _NormNet(), torch.randn(2, 4, 6, 6)
    plan = remat.optimize(copy.deepcopy(model), activation_budget=10**9, example_inputs=(x,),
                          execution="eager")
    plans = {}
    for path, block in block_plans(plan).items():
        keep = frozenset(k for k, t in enumerate(block.targets)
                         if t in ("aten.convolution.default", "aten.relu.default"))
        plans[path] = type(block)(path, block.targets, keep)
    eager = copy.deepcopy(model)
    compiled = compile_model_blocks(model, plans)
    compiled(x).backward()
    eager(x).backward()
    for (name, a), b in zip(eager.named_parameters(), model.parameters()):
        assert torch.allclose(a.grad, b.grad, rtol=1e-5, atol=1e-6), name
    for (name, a), b in zip(eager.named_buffers(), model.buffers()):
        assert torch.equal(a, b), name


class _TwoOutputs(torch.nn.Module):
    """As Swin's stages: the block returns its output and the output reshaped, which the
    model never reads."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(_D, _D)

    def forward(self, x):
        out = torch.tanh(self.lin(x)) * x + x
        return out, out.view(-1, _S // 2, 2 * _D).permute(0, 2, 1).contiguous() * 2


class _FirstOutputOnly(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(_TwoOutputs() for _ in range(2))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)[0]
        return x.pow(2).sum()


def test_a_block_output_the_loss_never_reads_needs_no_decision(caplog):
    """The whole step's capture drops the second output's ops (dead code); the block compiled
    alone computes them. No backward op needs them: they are not kept, every other op follows
    the plan, and the gradients equal eager PyTorch's."""
    torch.manual_seed(0)
    warnings = _compiled_blocks_train_as_eager(_FirstOutputOnly(), torch.randn(4, _S, _D), 0.9,
                                               caplog)
    assert "4 the plan never saw and no backward op needs (from op 7, aten.view.default)" \
        in warnings
