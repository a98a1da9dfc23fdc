"""A Hugging Face model that returns its key/value cache from a training step: the compiled
plan holds the cache to the end of the step, as eager would, and the allocator's peak is the
prediction, not the prediction plus the cache: the step returns the cache's tensors detached,
so autograd makes no zero gradients of their size for them. T5's
decoder keeps a config of its own: the warning names it. The eager mode refuses a model whose
forward builds a cache before capturing it, and plans an encoder whatever its use_cache."""
from __future__ import annotations

import copy
import logging

import pytest
import torch

import remat
from remat.fx_passes.measuring.allocator import step_peak
from remat.fx_passes.tracing.torch_version import torch_at_least
from remat.solvers import SolverOptions

transformers = pytest.importorskip("transformers")


def measured_activations(plan, model, kwargs) -> tuple[int, object]:
    for _ in range(2):  # the first call compiles
        for p in model.parameters():
            p.grad = None
        peak, out = step_peak(lambda: plan.module(**kwargs),
                              lambda o, seed: o.loss.backward(seed))
        cache = out.past_key_values
        del out
    grads = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters())
    return peak - grads, cache


def planned(model, kwargs):
    model.train()
    save_all = remat.optimize(model, activation_budget=10**12, example_kwargs=kwargs,
                              solver="save_all").activation_peak
    return remat.optimize(model, activation_budget=save_all // 2, example_kwargs=kwargs,
                          solver_options=SolverOptions(time_limit=5))


def test_a_returned_cache_is_in_the_prediction_and_nothing_more():
    torch.manual_seed(0)
    ids = torch.randint(0, 99, (13, 7))
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=99, hidden_size=32, intermediate_size=37, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, use_cache=True))
    kwargs = {"input_ids": ids, "labels": ids}
    plan = planned(model, kwargs)
    measured, cache = measured_activations(plan, model, kwargs)
    assert not cache.layers[0].keys.requires_grad  # returned, detached like the logits
    held = sum(t.numel() * t.element_size() for layer in cache.layers
               for t in (layer.keys, layer.values))
    assert held == 2 * 2 * 13 * 2 * 7 * 16 * 4  # layers, K and V, batch, heads, seq, dim, fp32
    assert plan.activation_peak - 64 <= measured <= plan.activation_peak


@pytest.mark.skipif(
    not torch_at_least(2, 13),
    reason="torch 2.11's dynamo cannot trace the copy.deepcopy of the config that T5's decoder "
    "makes when it builds its cache in the forward (a graph break remat names; "
    "docs/limitations.md)")
def test_t5_decoder_cache_is_named_and_held_within_the_prediction(caplog):
    torch.manual_seed(0)
    model = transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=99, d_model=32, d_ff=37, d_kv=8, num_layers=1, num_heads=4,
        dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0))
    model.config.use_cache = False  # does not reach the decoder's own config
    assert model.decoder.config.use_cache is True
    kwargs = {"input_ids": torch.randint(0, 99, (13, 7)),
              "labels": torch.randint(0, 99, (13, 9))}
    with caplog.at_level(logging.WARNING, logger="remat.planner.plans.prepare"):
        plan = planned(model, kwargs)
    assert any("model.decoder.config" in r.getMessage() for r in caplog.records)
    measured, _ = measured_activations(plan, model, kwargs)
    assert plan.activation_peak - 64 <= measured <= plan.activation_peak


def tiny_t5():
    return transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=99, d_model=32, d_ff=37, d_kv=8, num_layers=1, num_heads=4,
        dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0))


BERT = dict(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=37, max_position_embeddings=64)


@pytest.mark.parametrize("build, caching", [
    (lambda: transformers.BertForMaskedLM(transformers.BertConfig(**BERT)), []),
    (lambda: transformers.BertLMHeadModel(transformers.BertConfig(is_decoder=True, **BERT)),
     ["model.config"]),
    # declares is_decoder=False, and its layers cache all the same
    (lambda: transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(**BERT)),
     ["model.config"]),
    (lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**BERT)), ["model.config"]),
    (tiny_t5, ["model.config", "model.decoder.config"]),
])
def test_the_configs_named_are_those_whose_forward_builds_a_cache(build, caching):
    from remat.planner.plans.prepare import cache_configs

    assert cache_configs(build()) == caching


def test_eager_planning_refuses_a_decoder_cache_before_capturing(monkeypatch):
    """T5 as a trainer sets it up (model.config.use_cache=False): its decoder's own config
    still builds a cache, which a recomputed block would append to again. Refused at once,
    naming that config and the remedy, not after the planning (80 s) at plan.apply."""
    import remat.planner.optimize as optimize_module

    def no_capture(*args, **kwargs):
        raise AssertionError("captured before the cache was refused")

    monkeypatch.setattr(optimize_module, "prepare", no_capture)
    model = tiny_t5().train()
    model.config.use_cache = False
    kwargs = {"input_ids": torch.randint(0, 99, (2, 7)), "labels": torch.randint(0, 99, (2, 9))}
    with pytest.raises(remat.RematError) as refused:
        remat.optimize(model, activation_budget=10**9, example_kwargs=kwargs,
                       execution="eager")
    message = str(refused.value)
    assert message.startswith('remat.optimize(..., execution="eager"): model.decoder.config')
    assert "model.decoder.config.use_cache = False" in message
    assert "model.config.use_cache" not in message  # already off: not named


def test_an_encoder_whose_config_says_use_cache_is_planned_and_applied():
    """BERT's masked LM (is_decoder=False) never builds a cache, whatever its config's
    use_cache (True by default): planned eagerly, applied, and trained with eager's
    gradients."""
    torch.manual_seed(0)
    model = transformers.BertForMaskedLM(transformers.BertConfig(**BERT)).train()
    assert model.config.use_cache is True and model.config.is_decoder is False
    ids = torch.randint(2, 99, (4, 16))
    kwargs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    reference = copy.deepcopy(model)
    plan = remat.optimize(model, activation_budget=10**9, example_kwargs=kwargs,
                          solver="checkpoint_blocks", execution="eager")
    model = plan.apply(model)
    for m in (model, reference):
        torch.manual_seed(3)
        m(**kwargs).loss.backward()
    for (name, a), (_, b) in zip(reference.named_parameters(), model.named_parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-7, msg=name)
