"""Mixture-of-experts models: a plan holds from step to step while the tokens each expert
gets change, and no routing decision is made again in the backward (`Reason.DATA`: kept from
the forward; in eager mode cached, or replayed by checkpoint when the block overwrites it in
place, as Mixtral's router does with its top-k weights)."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import remat
from remat.solvers import Reason, SolverOptions
from tests.gradients import REORDERED_SUMS, relative_grad_gap

transformers = pytest.importorskip("transformers")


def mixtral():
    torch.manual_seed(0)
    # transformers' default grouped-mm experts fail in eager PyTorch on the CPU; batched_mm
    # computes the same experts with one bmm over (token, expert) pairs
    config = transformers.MixtralConfig(
        vocab_size=99, hidden_size=32, intermediate_size=37, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2, use_cache=False, experts_implementation="batched_mm")
    return transformers.MixtralForCausalLM(config).train()


def batches(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        ids = torch.randint(0, 99, (13, 7), generator=g)
        yield {"input_ids": ids, "labels": ids}


def routed(model, kwargs) -> torch.Tensor:
    """Tokens per expert in the first layer for this batch."""
    with torch.no_grad():
        hidden = model.model.embed_tokens(kwargs["input_ids"])
        layer = model.model.layers[0]
        logits = layer.mlp.gate(layer.post_attention_layernorm(hidden).view(-1, 32))
        logits = logits[0] if isinstance(logits, tuple) else logits
        top = torch.topk(logits, 2, dim=-1).indices
    return torch.bincount(top.flatten(), minlength=4)


@pytest.mark.parametrize("execution", ["compiled", "eager"])
def test_a_plan_holds_from_step_to_step_while_the_routing_changes(execution):
    model = mixtral()
    steps = list(batches(8))
    assert len({tuple(routed(model, b).tolist()) for b in steps}) > 1  # the routing changes
    save_all = remat.optimize(copy.deepcopy(model), activation_budget=10**12,
                              example_kwargs=steps[0], solver="save_all").activation_peak
    # eager's per-block policies reach less far than the compiled plan (a block recomputes all
    # at once); both recompute at these budgets
    fraction = 0.5 if execution == "compiled" else 1.2
    plan = remat.optimize(model, activation_budget=int(fraction * save_all),
                          example_kwargs=steps[0], execution=execution,
                          solver_options=SolverOptions(time_limit=5))
    assert plan.schedule.recomputed
    reference = copy.deepcopy(model)
    run = plan.apply(model) if execution == "eager" else plan.module
    for i, kwargs in enumerate(steps):
        for m in (model, reference):
            m.zero_grad(set_to_none=True)
        for m, call in ((model, run), (reference, reference)):
            torch.manual_seed(i)
            call(**kwargs).loss.backward()
        # relative to the gradients' size: the experts' accumulation (index_put with
        # accumulate on the CPU) and the compiled step's decompositions sum in another order,
        # whichever ops the plan (made under a time limit) recomputes
        assert relative_grad_gap(model, reference) <= REORDERED_SUMS, i


class TopKRouter(nn.Module):  # Qwen2-MoE's router without normalization: top-k kept as is
    def __init__(self, d=16, experts=4):
        super().__init__()
        self.gate = nn.Linear(d, experts)
        self.experts = nn.ModuleList(nn.Linear(d, d) for _ in range(experts))

    def forward(self, x):
        weights, chosen = torch.softmax(self.gate(x), dim=-1).topk(2, dim=-1)
        out = torch.stack([e(x) for e in self.experts], dim=-2)  # every expert, dense
        picked = out.gather(-2, chosen.unsqueeze(-1).expand(*chosen.shape, x.shape[-1]))
        return x + (picked * weights.unsqueeze(-1)).sum(-2)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(TopKRouter() for _ in range(3))

    def forward(self, x, y):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return ((x - y) ** 2).mean()


@pytest.mark.parametrize("execution", ["compiled", "eager"])
def test_a_routing_decision_is_kept_from_the_forward(execution):
    torch.manual_seed(0)
    model = Net()
    x, y = torch.randn(8, 5, 16), torch.randn(8, 5, 16)
    reference = copy.deepcopy(model)
    reference(x, y).backward()
    # the least budget each mode reaches: everything else recomputed
    with pytest.raises(remat.BudgetError) as refused:
        remat.optimize(model, activation_budget=1, example_inputs=(x, y), execution=execution)
    least = refused.value.smallest
    plan = remat.optimize(model, activation_budget=least, example_inputs=(x, y),
                          execution=execution)
    problem = plan.eager_problem if execution == "eager" else plan.prepared.problem
    decisions = {v for v, op in enumerate(problem.ops) if op.not_recomputable is Reason.DATA}
    assert [problem.ops[v].target for v in decisions] == ["aten.topk.default"] * 3
    assert plan.schedule.recomputed and not decisions & plan.schedule.recomputed
    if execution == "eager":
        for policy in plan.block_policies.values():
            [k] = [k for k, op in enumerate(policy.ops) if op == "aten.topk.default"]
            assert k in policy.keep and k in policy.cache
        run = plan.apply(model)
    else:
        run = plan.module
    run(x, y).backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p.grad, q.grad)


def shipped_dbrx():
    """transformers' DBRX as it ships (its tester's configuration, 8 experts, top 4)."""
    torch.manual_seed(0)
    config = transformers.DbrxConfig(
        vocab_size=99, d_model=32, n_layers=2, n_heads=2, max_seq_len=512,
        attn_config={"clip_qkv": 8, "rope_theta": 500000},
        ffn_config={"ffn_hidden_size": 32, "moe_jitter_eps": 0, "moe_loss_weight": 0.05,
                    "moe_num_experts": 8, "moe_top_k": 4, "ffn_act_fn": {"name": "gelu"}},
        pad_token_id=0, use_cache=False)
    return transformers.DbrxForCausalLM(config).train()


@pytest.mark.parametrize("execution", ["compiled", "eager"])
def test_shipped_dbrx_is_refused_with_the_change_then_planned(execution):
    """DBRX's experts loop over the experts a batch hits (a length read from the data): the
    capture is refused naming the call that changes it, `remat.every_expert`, after which
    the model is planned and trains as the shipped model does."""
    model = shipped_dbrx()
    shipped = copy.deepcopy(model)
    kwargs = next(batches(1))
    with pytest.raises(remat.CaptureError, match=r"DbrxExperts loops `for expert_idx in "
                                                 r"expert_hit`.*remat\.every_expert\(model\)"):
        remat.optimize(model, activation_budget=10**9, example_kwargs=kwargs,
                       solver="checkpoint_blocks", execution=execution)
    plan = remat.optimize(remat.every_expert(model), activation_budget=10**9,
                          example_kwargs=kwargs, solver="checkpoint_blocks",
                          execution=execution)
    run = plan.module if execution == "compiled" else plan.apply(model)
    for step, batch in enumerate(batches(2, seed=5)):
        for m in (model, shipped):
            m.zero_grad(set_to_none=True)
        torch.manual_seed(step)
        run(**batch).loss.backward()
        torch.manual_seed(step)
        shipped(**batch).loss.backward()
        assert relative_grad_gap(model, shipped) <= REORDERED_SUMS, (execution, step)
    with pytest.raises(remat.RematError, match="holds no DbrxExperts"):
        remat.every_expert(mixtral())
