"""An eager plan under torch.compile: `torch.compile(model)` of an applied model, and
per-block compile (`torch.compile(block)` for each block, torchtitan's pattern), run the
plan's decisions: the matmuls the plan recomputes are counted in the compiled backward graphs,
and the gradients equal plain torch.compile's. Plain torch.compile recomputes no matmul; the
compiled plan recomputes at most the plan's (eager checkpoint reruns every uncached op up to
its stop, the partitioner only those whose outputs the backward reads: a block's last matmul,
read by nothing but the residual add, is not run again).

AOTAutograd with graph-recording compilers (no Inductor: its C++ compile is slow on the CPU)
sees exactly what Inductor would be handed; dropout is off so that the compiled steps draw no
random numbers and plain torch.compile is a bitwise reference."""
from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.backends.debugging import boxed_nop
from torch._functorch.partitioners import (default_partition,
                                           min_cut_rematerialization_partition)

import remat
from remat.errors import RematError
from remat.fx_passes.eager.apply import apply_eager
from remat.fx_passes.eager.call_guard import current
from remat.solvers import SolverOptions
from tests import models

ADDMM = "aten.addmm.default"


@pytest.fixture(scope="module")
def planned():
    model, inputs = models.gpt(models.GPTConfig(dropout=0.0))
    save_all = remat.optimize(copy.deepcopy(model), activation_budget=10**12,
                              example_inputs=inputs, solver="save_all").activation_peak
    plan = remat.optimize(copy.deepcopy(model), activation_budget=int(0.6 * save_all),
                          example_inputs=inputs, execution="eager",
                          solver_options=SolverOptions(time_limit=5))
    return model, inputs, plan


def recording(partition_fn=default_partition):
    """A backend that records the forward and backward graphs AOTAutograd compiles."""
    graphs: dict[str, list[torch.fx.GraphModule]] = {"forward": [], "backward": []}

    def compiler(phase):
        def compile_graph(gm, example_inputs):
            graphs[phase].append(gm)
            return boxed_nop(gm, example_inputs)  # aot_eager's own
        return compile_graph

    return graphs, aot_autograd(fw_compiler=compiler("forward"), bw_compiler=compiler("backward"),
                                partition_fn=partition_fn)


def count(graphs, target: str) -> int:
    return sum(str(n.target) == target for gm in graphs for n in gm.graph.nodes
               if n.op == "call_function")


def planned_recomputations(plan, target: str) -> int:
    """How many times the plan's block policies recompute `target` (positions not cached)."""
    total = 0
    for planned in plan.block_policies.values():
        policy = current(planned)
        total += sum(name == target for k, name in enumerate(policy.ops) if k not in policy.cache)
    return total


def step(call, model, inputs):
    model.zero_grad(set_to_none=True)
    call(*inputs).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def plain_compiled(model, inputs):
    reference = copy.deepcopy(model)
    graphs, backend = recording()
    return step(torch.compile(reference, backend=backend), reference, inputs), graphs


def test_torch_compile_of_an_applied_model_runs_the_plans_recomputations(planned):
    model, inputs, plan = planned
    expected = planned_recomputations(plan, ADDMM)
    assert expected > 0  # the plan recomputes matmuls: the count below can tell
    reference, plain = plain_compiled(model, inputs)
    applied = plan.apply(copy.deepcopy(model))
    graphs, backend = recording()
    grads = step(torch.compile(applied, backend=backend), applied, inputs)
    assert count(plain["backward"], ADDMM) == 0
    assert 0 < count(graphs["backward"], ADDMM) <= expected
    for name, grad in grads.items():
        assert torch.equal(grad, reference[name]), name


def test_each_block_compiled_on_its_own_runs_the_plans_recomputations(planned):
    model, inputs, plan = planned
    reference, plain = plain_compiled(model, inputs)
    applied = plan.apply(copy.deepcopy(model))
    graphs, backend = recording()
    for i, block in enumerate(applied.h):  # torchtitan: torch.compile(block), then fully_shard
        applied.h[i] = torch.compile(block, backend=backend)
    grads = step(applied, applied, inputs)
    assert count(plain["backward"], ADDMM) == 0
    assert 0 < count(graphs["backward"], ADDMM) <= planned_recomputations(plan, ADDMM)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, reference[name.replace("._orig_mod", "")],
                                   rtol=1e-5, atol=1e-7, msg=name)


def test_a_plan_with_a_policy_per_bucket_is_refused_under_torch_compile(planned):
    """Batch 1 dispatches other ops than batches 2 to 4: a policy for each, which a traced
    block cannot choose between."""
    model, (idx, targets), _ = planned
    plan = remat.optimize(copy.deepcopy(model), activation_budget=10**12,
                          example_inputs=(idx, targets), execution="eager",
                          solver="checkpoint_blocks", dynamic={"batch": (1, 4)})
    applied = plan.apply(copy.deepcopy(model))
    _, backend = recording()
    # raised while AOTAutograd traces, so dynamo wraps it in its BackendCompilerFailed
    with pytest.raises(Exception, match="a plan for a range of shapes") as raised:
        torch.compile(applied, backend=backend)(idx, targets).backward()
    cause = raised.value
    while cause is not None and not isinstance(cause, RematError):
        cause = cause.__cause__ or cause.__context__
    assert isinstance(cause, RematError)


def test_a_hugging_face_model_called_with_keywords_compiles_with_its_plan():
    """A plan made from keyword inputs carries the call's checks in each block's policy (a
    frozen dataclass dynamo could not pass to a function on torch 2.11): the traced blocks
    find their policy by a key read off it."""
    pytest.importorskip("transformers")
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=128, vocab_size=128,
                         use_cache=False)
    model = Qwen2ForCausalLM(config).train()
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    kwargs = {"input_ids": ids, "labels": ids}
    plan = remat.optimize(copy.deepcopy(model), activation_budget=10**12, example_kwargs=kwargs,
                          execution="eager", solver="checkpoint_blocks")
    applied = plan.apply(copy.deepcopy(model))
    graphs, backend = recording()
    torch.compile(applied, backend=backend)(**kwargs).loss.backward()
    reference = copy.deepcopy(model)
    plain, plain_backend = recording()
    torch.compile(reference, backend=plain_backend)(**kwargs).loss.backward()
    # every block checkpointed: its matmuls run again in the compiled backward
    assert count(graphs["backward"], "aten.mm.default") > count(plain["backward"],
                                                                "aten.mm.default")
    for (name, p), q in zip(applied.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=name)


def saved_bytes(graphs) -> int:
    """Bytes the forward graphs hand the backward (their outputs past the first: the loss)."""
    total = 0
    for gm in graphs["forward"]:
        outputs = next(n for n in gm.graph.nodes if n.op == "output").args[0]
        for node in outputs[1:]:
            value = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
            if isinstance(value, torch.Tensor):
                total += value.untyped_storage().nbytes()
    return total


def test_prefer_save_lets_the_min_cut_partitioner_recompute_pointwise_ops():
    """A plan made for torch.compile caches with PREFER_SAVE: Inductor's min-cut partitioner
    (here with graph-recording compilers) saves fewer bytes than with MUST_SAVE, recomputing
    only ops on its allowlist (no more matmuls), with the same gradients. The Llama's SwiGLU
    and RMSNorm have cached pointwise values that only pointwise backward ops read."""
    from examples.llama import LLAMA_TEST, tiny_llama

    model, inputs = tiny_llama(LLAMA_TEST, batch=2)
    # Each block caches every op it may: what it caches decides the bytes saved.
    plan = remat.optimize(copy.deepcopy(model), activation_budget=10**12, example_inputs=inputs,
                          execution="eager", solver_options=SolverOptions(time_limit=5))
    runs = {}
    for prefer in (False, True):
        policies = {p: replace(current(pol), prefer_save=prefer)
                    for p, pol in plan.block_policies.items()}
        applied = apply_eager(copy.deepcopy(model), policies)
        graphs, backend = recording(min_cut_rematerialization_partition)
        torch._dynamo.reset()
        torch.manual_seed(0)  # the same dropout masks in both runs
        runs[prefer] = graphs, step(torch.compile(applied, backend=backend), applied, inputs)
    (must, must_grads), (prefer, prefer_grads) = runs[False], runs[True]
    assert saved_bytes(prefer) < 0.99 * saved_bytes(must), (saved_bytes(prefer), saved_bytes(must))
    assert count(prefer["backward"], "aten.mm.default") == count(must["backward"],
                                                                 "aten.mm.default")
    for name, grad in prefer_grads.items():
        torch.testing.assert_close(grad, must_grads[name], rtol=1e-6, atol=1e-8, msg=name)


def test_a_block_that_breaks_the_graph_recomputes_its_in_place_draw():
    """A block dynamo cannot trace as one graph (a size read from data, as in DBRX's expert
    dispatch) runs its checkpoint eagerly with the traced policy, which then sees in-place
    random ops (DBRX's router jitter: ``empty_like(x).uniform_()``). Cached, the drawn tensor is the one ``empty_like`` made, and checkpoint
    refused it as mutated; recomputed, checkpoint's replayed generator draws it again."""

    class Jitter(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)

        def forward(self, x):
            h = self.a(x)
            h = h * torch.empty_like(h).uniform_(0.9, 1.1)
            rows = torch.nonzero(h[:, 0] > 0).squeeze(-1)  # a data-dependent size: no HOP
            h = h.index_add(0, rows, torch.tanh(h[rows]))
            return self.b(torch.tanh(h))

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList([Jitter(), Jitter()])

        def forward(self, x):
            for block in self.blocks:
                x = block(x)
            return x.square().mean()

    torch.manual_seed(0)
    model, x = Model(), torch.randn(8, 16)
    plan = remat.optimize(copy.deepcopy(model), activation_budget=10**9, example_inputs=(x,),
                          execution="eager", solver_options=SolverOptions(time_limit=5))
    reference = copy.deepcopy(model)
    torch.manual_seed(1)
    want = step(reference, reference, (x,))
    applied = plan.apply(copy.deepcopy(model))
    torch._dynamo.reset()
    torch.manual_seed(1)
    got = step(torch.compile(applied, backend="aot_eager"), applied, (x,))
    for name, grad in got.items():
        torch.testing.assert_close(grad, want[name], rtol=1e-6, atol=1e-7, msg=name)
