"""A block whose policy caches nothing runs as plain `torch.utils.checkpoint` from its second
call on: its ops were matched against the plan at the first call, and the policy decides
nothing, so selective checkpoint's per-op dispatch is skipped. The same step, the same
memory, eager's gradients; the first call still refuses a block whose ops differ."""
from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch

import remat.fx_passes.eager.selective as selective
from remat.errors import RematError
from remat.fx_passes.eager.apply import apply_eager
from remat.fx_passes.eager.block_policy import with_cache
from remat.fx_passes.measuring.allocator import peak_and_result as allocator_peak
from remat.planner.plans.eager_plan import plan_eager_mode
from remat.planner.plans.prepare import prepare
from remat.solvers import Strategy
from examples.llama import LLAMA_TEST, tiny_llama


def _per_block(model, inputs):
    plan = plan_eager_mode(model, prepare(model, inputs), budget=None,
                           activation_budget=10**12, target="h100",
                           solver=Strategy.CHECKPOINT_BLOCKS, solver_options=None, blocks=None,
                           example_inputs=inputs)
    return {path: with_cache(p, ()) for path, p in plan.block_policies.items()}


def _step(model, inputs):
    torch.manual_seed(3)
    model(*inputs).backward()


def test_a_policy_that_caches_nothing_runs_as_plain_checkpoint_after_its_first_call(
        monkeypatch):
    model, inputs = tiny_llama(replace(LLAMA_TEST, seq=32), batch=4)
    reference = copy.deepcopy(model)
    policies = _per_block(model, inputs)
    assert policies and all(not p.cache for p in policies.values())
    applied = apply_eager(copy.deepcopy(model), policies)
    decided = []
    original = selective.decider

    def counted(*args, **kwargs):
        decide = original(*args, **kwargs)

        def wrapper(*a, **k):
            decided.append(1)
            return decide(*a, **k)
        return wrapper

    monkeypatch.setattr(selective, "decider", counted)
    first, _ = allocator_peak(lambda: _step(applied, inputs))
    assert decided, "the first call runs selective checkpoint and its op check"
    decided.clear()
    applied.zero_grad(set_to_none=True)
    second, _ = allocator_peak(lambda: _step(applied, inputs))
    assert not decided, "the second call decides nothing per op"
    assert second == first
    _step(reference, inputs)
    for (name, p), q in zip(applied.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_the_first_call_still_refuses_a_block_whose_ops_differ():
    model, inputs = tiny_llama(replace(LLAMA_TEST, seq=32), batch=4)
    policies = _per_block(model, inputs)
    path = next(iter(policies))
    policies[path] = replace(policies[path], ops=policies[path].ops[:-1])
    applied = apply_eager(copy.deepcopy(model), policies)
    with pytest.raises(RematError, match="ops"):
        _step(applied, inputs)
