"""The applied model stays a model: evaluation (no_grad, inference_mode, eval(), generate) runs
it plainly in both execution modes, with outputs equal to the untouched model's; training in
the other mode than the plan's is refused at the backward; planning leaves the model and its
config as they were. A tiny Hugging Face GPT-2 built from a config, nothing downloaded."""
import copy
import dataclasses

import pytest
import torch

import remat
from remat.errors import RematError
from remat.fx_passes.eager.apply import apply_eager

pytest.importorskip("transformers")

VOCAB, SEQ, BATCH = 128, 16, 4


def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=2,
                        use_cache=False)  # dropout 0.1 by default
    torch.manual_seed(0)
    return GPT2LMHeadModel(config).train()


def batch(seq: int = SEQ):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (BATCH, seq), generator=g)
    return {"input_ids": ids, "labels": ids}


def applied(mode: str):
    """(the untouched model, the model the plan runs on, what to call for a step)."""
    model = gpt2()
    untouched = copy.deepcopy(model)
    plan = remat.optimize(model, activation_budget=10**9, example_kwargs=batch(),
                          execution=mode, solver="checkpoint_blocks")
    if mode == "compiled":  # checkpoint every block: recomputed, dropout included
        assert plan.recompute_flops > 0
        return untouched, model, plan.module
    # The eager plan caches everything at this budget: recompute every op of each block.
    policies = {path: dataclasses.replace(policy, cache=frozenset())
                for path, policy in plan.block_policies.items()}
    assert all(policy.training is True for policy in policies.values())
    return untouched, apply_eager(model, policies), model


def same_call(a, b, kwargs, seed=3):
    torch.manual_seed(seed)
    out_a = a(**kwargs)
    torch.manual_seed(seed)
    out_b = b(**kwargs)
    return out_a, out_b


@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_evaluation_runs_the_applied_model_plainly(mode):
    untouched, model, step = applied(mode)
    longer = batch(seq=24)  # another shape than planned: fine without the plan
    for kwargs in (batch(), longer):
        with torch.no_grad():  # train mode, dropout on: the same masks from the same seed
            mine, theirs = same_call(step, untouched, kwargs)
        assert torch.equal(mine.loss, theirs.loss) and torch.equal(mine.logits, theirs.logits)
        with torch.inference_mode():
            mine, theirs = same_call(step, untouched, kwargs)
        assert torch.equal(mine.loss, theirs.loss) and torch.equal(mine.logits, theirs.logits)
    model.eval(), untouched.eval()
    with torch.no_grad():
        mine, theirs = same_call(step, untouched, longer)
    assert torch.equal(mine.logits, theirs.logits)
    mine, theirs = same_call(step, untouched, batch())  # eval() with grad enabled: runs ...
    assert torch.equal(mine.loss, theirs.loss)
    with pytest.raises(RematError, match="planned in train mode, but the model is in eval mode "
                                         r"now; call model.train\(\)"):
        mine.loss.backward()  # ... but training on it without the plan is refused
    prompt = batch()["input_ids"][:, :4]
    generate = dict(max_new_tokens=5, do_sample=False, attention_mask=torch.ones_like(prompt),
                    pad_token_id=0, use_cache=True)  # the cache a training plan never sees
    assert torch.equal(step.generate(prompt, **generate), untouched.generate(prompt, **generate))
    model.train(), untouched.train()
    # Nothing requires grad (a frozen model), grad enabled: no graph, nothing to plan.
    for p in (*model.parameters(), *untouched.parameters()):
        p.requires_grad_(False)
    mine, theirs = same_call(step, untouched, longer)
    assert torch.equal(mine.loss, theirs.loss) and not mine.loss.requires_grad
    for p in (*model.parameters(), *untouched.parameters()):
        p.requires_grad_(True)
    # After all that, a training step still runs the plan, with eager's gradients. (The
    # refused backward above may have left gradients in the layers after the blocks.)
    model.zero_grad(set_to_none=True)
    mine, theirs = same_call(step, untouched, batch())
    mine.loss.backward(), theirs.loss.backward()
    assert torch.equal(mine.loss, theirs.loss)
    for (name, a), b in zip(untouched.named_parameters(), model.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-7, msg=name)


def test_an_eager_training_call_of_other_ops_than_planned_is_still_refused():
    _, model, _ = applied("eager")
    with pytest.raises(RematError, match="ops differ between capture and run"):
        model(**batch(), use_cache=True)  # grad on, train mode: the plan must hold


def snapshot(model) -> dict:
    """Every module's attributes (by identity for objects, by value for plain data), each
    parameter's gradient and requires_grad, the config and the generation config."""
    seen = {}
    for name, module in model.named_modules():
        for key, value in vars(module).items():
            if key in ("_parameters", "_buffers", "_modules"):
                value = {k: id(v) for k, v in value.items()}
            elif not isinstance(value, (str, int, float, bool, type(None))):
                value = id(value)
            seen[(name, key)] = value
        for key, p in module.named_parameters(recurse=False):
            seen[(name, key, "grad")] = id(p.grad) if p.grad is not None else None
            seen[(name, key, "requires_grad")] = p.requires_grad
    seen["config"] = model.config.to_dict()
    seen["generation_config"] = model.generation_config.to_dict()
    return seen


@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_planning_leaves_the_model_and_its_config_as_they_were(mode):
    model = gpt2()
    assert model.loss_type is None  # GPT2LMHeadModel's own: the Trainer reads it
    before = snapshot(model)
    rng = torch.get_rng_state()
    plan = remat.optimize(model, activation_budget=10**9, example_kwargs=batch(),
                          execution=mode, solver="checkpoint_blocks")
    assert snapshot(model) == before
    assert torch.equal(torch.get_rng_state(), rng)  # nor the generator the user trains with
    if mode == "compiled":  # the planned step names the loss only while it runs
        for _ in range(2):
            plan.module(**batch()).loss.backward()
        assert model.loss_type is None and model.transformer.loss_type is None
        assert len(plan.module.partitions) == 1  # and it was compiled once
