"""The state of a step from the configuration alone: the bytes per parameter of each precision
and optimizer, and published reference figures (a 7B decoder, GPT-2 small)."""
import math
from types import SimpleNamespace

import pytest

from remat.planner.job.training import (ADAM8BIT_BLOCK, Optimizer, Precision, Training,
                                    optimizer_state_bytes, state_memory)

H, LAYERS, VOCAB = 4096, 32, 32000


def llama7b_shapes():
    """A 7B-class decoder (h=4096, 32 layers, vocabulary 32,000): 12*L*h^2 + 2*V*h (untied
    embeddings, no norms)."""
    shapes = [("embed.weight", (VOCAB, H)), ("lm_head.weight", (VOCAB, H))]
    for i in range(LAYERS):
        for name, shape in [("q", (H, H)), ("k", (H, H)), ("v", (H, H)), ("o", (H, H)),
                            ("up", (4 * H, H)), ("down", (H, 4 * H))]:
            shapes.append((f"layers.{i}.{name}.weight", shape))
    return shapes


def gb(nbytes):
    return round(nbytes / 1e9)


def test_7b_parameter_count():
    state = state_memory(llama7b_shapes(), Training())
    assert state.parameters == 12 * LAYERS * H**2 + 2 * VOCAB * H
    assert f"{state.parameters:.2e}" == "6.70e+09"


@pytest.mark.parametrize("precision, per_param, gigabytes", [
    ("fp32", 16, 107), ("bf16-mixed", 18, 121), ("bf16", 16, 107), ("fp16", 14, 94),
])
def test_7b_state(precision, per_param, gigabytes):
    state = state_memory(llama7b_shapes(), Training(precision=precision, optimizer="adam"))
    assert state.total == per_param * state.parameters
    assert gb(state.total) == gigabytes


@pytest.mark.parametrize("precision, gigabytes", [("fp32", 112), ("bf16-mixed", 126),
                                                  ("fp16", 98)])
def test_flat_7e9(precision, gigabytes):
    state = state_memory([(7_000_000_000,)], Training(precision=precision, optimizer="adamw"))
    assert gb(state.total) == gigabytes


@pytest.mark.parametrize("precision, weights, master, grads", [
    (Precision.FP32, 4, 0, 4), (Precision.BF16_MIXED, 2, 4, 4), (Precision.BF16, 2, 4, 2),
    (Precision.FP16, 2, 0, 4), (Precision.AUTOCAST, 4, 0, 4),
])
def test_table_per_parameter(precision, weights, master, grads):
    n = 1000
    state = state_memory([("w", (10, 100))], Training(precision=precision, optimizer="adam"))
    assert (state.weights, state.master, state.gradients, state.optimizer) == \
        (weights * n, master * n, grads * n, 8 * n)
    assert state.cast_copies == (2 * n if precision is Precision.AUTOCAST else 0)


@pytest.mark.parametrize("optimizer, per_param", [
    ("adam", 8), ("adamw", 8), ("sgd", 0), ("sgd_momentum", 4), ("lion", 4),
])
def test_optimizer_state_per_parameter(optimizer, per_param):
    assert optimizer_state_bytes(Optimizer(optimizer), (300, 200)) == per_param * 60_000


def test_adafactor_keeps_rows_and_columns():
    assert optimizer_state_bytes(Optimizer.ADAFACTOR, (300, 200)) == (300 + 200) * 4
    assert optimizer_state_bytes(Optimizer.ADAFACTOR, (5, 300, 200)) == (5 * 300 + 5 * 200) * 4
    assert optimizer_state_bytes(Optimizer.ADAFACTOR, (300,)) == 300 * 4  # vectors: full


def test_adam8bit_two_bytes_and_a_scale_per_block():
    n = 4096 * 1000
    assert optimizer_state_bytes(Optimizer.ADAM8BIT, (4096, 1000)) == \
        2 * n + 2 * 4 * math.ceil(n / ADAM8BIT_BLOCK)
    assert optimizer_state_bytes(Optimizer.ADAM8BIT, (100,)) == 800  # small tensors stay fp32
    state = state_memory([(7_000_000_000,)], Training(optimizer="adam8bit"))
    assert state.optimizer / state.parameters == pytest.approx(2.0, rel=0.01)


def test_zero_stages_shard_what_they_say():
    shapes = [(8_000_000,)]
    base = state_memory(shapes, Training(precision="bf16-mixed", optimizer="adam"))
    for stage, sharded in [(0, set()), (1, {"master", "optimizer"}),
                           (2, {"master", "optimizer", "gradients"}),
                           (3, {"master", "optimizer", "gradients", "weights"})]:
        state = state_memory(shapes, Training(precision="fp32", optimizer="adam",
                                              data_parallel=8, zero_stage=stage))
        fp32 = state_memory(shapes, Training(precision="fp32", optimizer="adam"))
        for term in ("weights", "master", "gradients", "optimizer"):
            expected = getattr(fp32, term) // 8 if term in sharded else getattr(fp32, term)
            assert getattr(state, term) == expected, (stage, term)
    # bf16-mixed: the same, but ZeRO-3 keeps no bf16 shard beside the fp32 one (below).
    state = state_memory(shapes, Training(precision="bf16-mixed", optimizer="adam",
                                          data_parallel=8, zero_stage=2))
    assert (state.weights, state.master) == (base.weights, base.master // 8)


def test_bf16_mixed_zero3_keeps_the_fp32_shard_only():
    """FSDP2 with MixedPrecisionPolicy(param_dtype=bf16) keeps fp32 shards (the master
    weights) and casts them to bf16 as it all-gathers: 16 bytes per parameter over the ranks,
    not 18 (counted at 18, the 7B on 8 ranks would be 15.16 GB)."""
    training = Training(precision="bf16-mixed", optimizer="adamw", data_parallel=8,
                        zero_stage=3)
    state = state_memory(llama7b_shapes(), training)
    assert state.weights == 0
    assert state.total == 16 * state.parameters // 8  # 13.41 GB; 13.48 GB at 6.74e9 params
    frozen = state_memory([("a", (800,)), ("b", (800,))],
                          Training(precision="bf16-mixed", data_parallel=8, zero_stage=3,
                                   frozen=["b"]))
    assert frozen.weights == 2 * 800 // 8  # a frozen parameter keeps its bf16 shard


def test_frozen_parameters_cost_their_weights_alone():
    shapes = [("base.weight", (100, 100)), ("lora.A", (100, 4)), ("lora.B", (4, 100))]
    by_pattern = state_memory(shapes, Training(optimizer="adam", frozen=["base.*"]))
    by_predicate = state_memory(shapes, Training(optimizer="adam",
                                                 frozen=lambda n: n.startswith("base")))
    frozen_flag = [("base.weight", SimpleNamespace(shape=(100, 100), requires_grad=False)),
                   ("lora.A", SimpleNamespace(shape=(100, 4), requires_grad=True)),
                   ("lora.B", SimpleNamespace(shape=(4, 100), requires_grad=True))]
    by_flag = state_memory(frozen_flag, Training(optimizer="adam"))
    for state in (by_pattern, by_predicate, by_flag):
        assert state.parameters == 10_800 and state.trainable == 800
        assert state.weights == 4 * 10_800
        assert state.gradients == 4 * 800 and state.optimizer == 8 * 800


def test_module_with_meta_parameters():
    torch = pytest.importorskip("torch")
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(1000, 2000), torch.nn.Linear(2000, 10))
    state = state_memory(model, Training(optimizer="adam"))
    assert state.parameters == 1000 * 2000 + 2000 + 2000 * 10 + 10
    assert state.total == 16 * state.parameters


def test_training_is_keyword_only_frozen_and_validated():
    with pytest.raises(TypeError):
        Training("fp32")  # keyword-only
    training = Training(precision="bf16-mixed", optimizer="adamw", reserve="512MiB")
    assert training.precision is Precision.BF16_MIXED and training.reserve == 512 * 2**20
    with pytest.raises(AttributeError):
        training.zero_stage = 2  # frozen
    assert Training().reserve == 2**30 and Training().fragmentation == 0.10
    assert Training().margin(60 * 10**9) == 6 * 10**9
    for bad in [dict(precision="fp8"), dict(optimizer="adagrad"), dict(zero_stage=4),
                dict(data_parallel=0), dict(fragmentation=1.0), dict(reserve="-1GB"),
                dict(data_parallel=True)]:
        with pytest.raises(ValueError):
            Training(**bad)
    with pytest.raises(ValueError, match="'bf16-mixed'"):
        Training(precision="bf16_mixed")  # the message lists the choices


def test_korthikanti_activation_figures():
    """The 7B decoder's activations at s=4096, b=1 by Korthikanti et al.'s (2022) formula: 104.2
    GB stored, 18.3 GB with FlashAttention, 1.1 GB with full recomputation; the formula that
    the captured graphs are checked against in the planner tests."""
    from tests.estimates import layer_activation_bytes
    s, b, a = 4096, 1, 32
    assert round(LAYERS * layer_activation_bytes(s, b, H, a) / 1e8) / 10 == 104.2
    assert round(LAYERS * layer_activation_bytes(s, b, H, a, flash=True) / 1e8) / 10 == 18.3
    assert round(LAYERS * layer_activation_bytes(s, b, H, a, full_recompute=True) / 1e8) / 10 \
        == 1.1


def test_gpt2_small_about_3_7_gb():
    """The reference figure for GPT-2 small, batch 8, sequence 512, mixed precision with Adam:
    about 3.7 GB in all. From the configuration: the parameters at 16 bytes each (bf16 weights
    and gradients, fp32 master, Adam), Korthikanti's 34*s*b*h per layer (an attention kernel
    that stores no s x s scores), and the bf16 logits b*s*V*2. (The captured graph of the same
    model needs more: Hugging Face's loss upcasts the logits to fp32 and keeps several
    vocabulary-sized buffers, and attention dropout keeps its masks; `examples/gpt2.py` shows
    that step.)"""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from tests.estimates import layer_activation_bytes

    config = transformers.GPT2Config()
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(config)
    state = state_memory(model, Training(precision="bf16", optimizer="adam"))
    assert state.parameters == 124_439_808  # the tied embedding counted once
    s, b = 512, 8
    activations = config.n_layer * layer_activation_bytes(s, b, config.n_embd, config.n_head,
                                                          flash=True)
    logits = b * s * config.vocab_size * 2
    assert round((state.total + activations + logits) / 1e8) / 10 == 3.7
