"""PEFT LoRA on a tiny Llama: eager and compiled plans through PEFT's wrappers (module paths
as ``base_model.model.model.layers.0``), only the adapters trained: the frozen base's weights
count as parameters, its gradients as none. Gradients equal plain PyTorch's, LoRA dropout on."""
import copy
import dataclasses

import pytest
import torch

import remat

pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

VOCAB, SEQ, BATCH = 128, 16, 2


def lora_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64, use_cache=False)
    torch.manual_seed(0)
    base = LlamaForCausalLM(config).train()
    lora = peft.LoraConfig(task_type="CAUSAL_LM", r=4, lora_alpha=8, lora_dropout=0.1,
                           target_modules=["q_proj", "v_proj"])
    model = peft.get_peft_model(base, lora)
    for p in model.parameters():  # PEFT starts lora_B at zero: no gradient reaches lora_A
        if p.requires_grad:
            torch.nn.init.normal_(p, std=0.02)
    return model


def batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return {"input_ids": ids, "labels": ids}


def check_step(untouched, model, step):
    torch.manual_seed(5)  # the same LoRA dropout masks in both
    expected = untouched(**batch())
    expected.loss.backward()
    torch.manual_seed(5)
    out = step(**batch())
    out.loss.backward()
    assert torch.equal(out.loss, expected.loss)
    trained = 0
    for (name, a), b in zip(untouched.named_parameters(), model.parameters()):
        if "lora_" in name:
            trained += 1
            torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-8, msg=name)
        else:  # the frozen base: no gradient at all
            assert not b.requires_grad and a.grad is None and b.grad is None, name
    assert trained == 8  # lora_A and lora_B of q_proj and v_proj in two layers


def check_state(plan, model):
    state = plan.prepared.state
    adapters = sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)
    assert state.parameters == sum(p.numel() for p in model.parameters())
    assert state.trainable == adapters
    assert state.weights == 4 * state.parameters  # fp32: every weight is held ...
    assert state.gradients == 4 * adapters  # ... the adapters alone get gradients


def test_an_eager_plan_through_peft_wrappers():
    from remat.fx_passes.eager.apply import apply_eager

    model = lora_llama()
    untouched = copy.deepcopy(model)
    plan = remat.optimize(model, activation_budget=10**9, example_kwargs=batch(),
                          execution="eager", solver="checkpoint_blocks")
    assert sorted(plan.policies) == ["base_model.model.model.layers.0",
                                     "base_model.model.model.layers.1"]
    check_state(plan, model)
    # Every op of each block recomputed (nothing cached): the LoRA dropout replayed too.
    policies = {path: dataclasses.replace(policy, cache=frozenset())
                for path, policy in plan.block_policies.items()}
    apply_eager(model, policies)
    check_step(untouched, model, model)
    with torch.no_grad():  # evaluation runs the blocks plainly
        torch.manual_seed(6)
        mine = model(**batch()).loss
        torch.manual_seed(6)
        assert torch.equal(mine, untouched(**batch()).loss)


def test_a_compiled_plan_of_a_peft_model():
    model = lora_llama()
    untouched = copy.deepcopy(model)
    plan = remat.optimize(model, activation_budget=10**9, example_kwargs=batch(),
                          solver="checkpoint_blocks")
    assert plan.recompute_flops > 0
    check_state(plan, model)
    check_step(untouched, model, plan.module)
