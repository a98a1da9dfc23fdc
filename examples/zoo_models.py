"""Hugging Face architectures as transformers' own test suite builds them: the tiny
configurations of each model's `ModelTester` (tests/models/<arch>/test_modeling_<arch>.py, and
tests/causal_lm_tester.py for the decoders that share `CausalLMModelTester`), their batch and
sequence sizes, dropout as they set it, inputs as their `prepare_config_and_inputs` makes them.
Nothing is downloaded; the numbers are written out here.

Where a tester's configuration cannot train on a CPU as it is, the change is named at its
entry: MoE experts as batched matmuls (transformers' default grouped-mm experts fail in eager
PyTorch on the CPU, "strides should be multiple of 16 bytes"), DeepSeek-V3 with its second
layer a MoE layer of 8 experts in 2 groups (the tester's first_k_dense_replace=3 leaves both
layers dense, and its 256 experts in 8 groups cannot pick 2 of 8), DBRX's experts looping over
every expert rather than over the experts a batch hits (`every_expert`: the same sums; a loop
whose length is read from the data cannot be one graph, while each expert's
``torch.where(mask)`` stays, a size that depends on the data), and no
key/value cache (`use_cache=False` on every config: training keeps none).

`ARCHS[name] = (family, build)`; ``build() -> (model, kwargs)``, the model in train mode.
"""
from __future__ import annotations

import inspect
from typing import Callable

import torch

BATCH, SEQ, VOCAB = 13, 7, 99

# CausalLMModelTester's attributes (tests/causal_lm_tester.py): `get_config` passes each one
# the configuration class takes by that name.
CAUSAL_LM = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=2, intermediate_size=37, hidden_act="gelu",
                 hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1,
                 max_position_embeddings=512, type_vocab_size=16, initializer_range=0.02,
                 pad_token_id=0, bos_token_id=1, eos_token_id=2, is_decoder=False,
                 moe_intermediate_size=12, shared_expert_intermediate_size=36,
                 shared_expert_gate=True, num_experts_per_tok=2, num_experts=8,
                 mamba_n_groups=1, mamba_n_heads=16, mamba_d_state=16, mamba_d_conv=4,
                 mamba_expand=2, mamba_chunk_size=16)

# BertModelTester and the encoders that copy it (RoBERTa, ELECTRA, XLM-R, MPNet, DeBERTa-v2)
ENCODER = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
               intermediate_size=37, hidden_act="gelu", hidden_dropout_prob=0.1,
               attention_probs_dropout_prob=0.1, max_position_embeddings=512,
               type_vocab_size=16, initializer_range=0.02)

# BartModelTester and its copies (mBART, Pegasus, Marian)
SEQ2SEQ = dict(vocab_size=VOCAB, d_model=16, encoder_layers=2, decoder_layers=2,
               encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=4,
               decoder_ffn_dim=4, dropout=0.1, attention_dropout=0.1,
               max_position_embeddings=20, eos_token_id=2, pad_token_id=1, bos_token_id=0,
               decoder_start_token_id=2)


def _generator() -> torch.Generator:
    return torch.Generator().manual_seed(1234)


def ids(shape, high, g) -> torch.Tensor:
    return torch.randint(0, high, shape, generator=g)


def random_attention_mask(g) -> torch.Tensor:
    """test_modeling_common.random_attention_mask: random 0/1, the last token always seen."""
    mask = ids((BATCH, SEQ), 2, g)
    mask[:, -1] = 1
    return mask


def _config(config_cls: str, fields: dict, **overrides):
    import transformers

    cls = getattr(transformers, config_cls)
    accepted = set(inspect.signature(cls.__init__).parameters)
    # set after construction: not fields of the class's own signature
    later = {k: overrides.pop(k) for k in ("experts_implementation", "num_labels",
                                           "decoder_start_token_id") if k in overrides}
    kwargs = {k: v for k, v in {**fields, **overrides}.items() if k in accepted}
    config = cls(**kwargs)
    if "experts_implementation" in later:
        config._experts_implementation = later.pop("experts_implementation")  # sub-configs too
    for key, value in later.items():
        setattr(config, key, value)
    _no_cache(config)
    return config


def _no_cache(config) -> None:
    for sub in [config] + [getattr(config, k, None) for k in ("text_config", "decoder")]:
        if sub is not None and hasattr(sub, "use_cache"):
            sub.use_cache = False


def _model(model_cls: str, config):
    import transformers

    return getattr(transformers, model_cls)(config).train()


def causal_lm(config_cls: str, model_cls: str, **overrides) -> Callable:
    """A decoder as CausalLMModelTester builds it: input ids, the tester's lower-triangular
    attention mask, the ids as language-model labels."""
    def build():
        g = _generator()
        input_ids = ids((BATCH, SEQ), VOCAB, g)
        model = _model(model_cls, _config(config_cls, CAUSAL_LM, **overrides))
        return model, {"input_ids": input_ids, "attention_mask": torch.tril(
            torch.ones_like(input_ids)), "labels": input_ids}
    return build


def moe(config_cls: str, model_cls: str, **overrides) -> Callable:
    return causal_lm(config_cls, model_cls, experts_implementation="batched_mm", **overrides)


def every_expert(build: Callable) -> Callable:
    """`build` with DBRX's experts looping over every expert (`dbrx_every_expert`)."""
    def patched():
        model, kwargs = build()
        return dbrx_every_expert(model), kwargs
    return patched


def dbrx_every_expert(model):
    """DBRX's experts (transformers 5.24 `DbrxExperts`) loop ``for expert_idx in expert_hit``,
    the experts this batch routes a token to: a loop of a length read from the data, which no
    one graph holds. `remat.every_expert` runs every expert, in the same order (the same sums).
    Per instance: the class is left as it is."""
    import remat

    return remat.every_expert(model)


def dbrx(experts: int = 16, top_k: int = 4, layers: int = 2) -> Callable:
    """DBRX as its tester configures it (16 experts, top 4, 2 layers), looping over every
    expert."""
    return every_expert(decoder("DbrxConfig", "DbrxForCausalLM", dict(
        vocab_size=VOCAB, d_model=32, n_layers=layers, n_heads=4, max_seq_len=512,
        attn_config={"clip_qkv": 8, "kv_n_heads": 4, "rope_theta": 500000},
        ffn_config={"ffn_hidden_size": 32, "moe_jitter_eps": 0, "moe_loss_weight": 0.05,
                    "moe_num_experts": experts, "moe_top_k": top_k,
                    "ffn_act_fn": {"name": "gelu"}},
        resid_pdrop=0.0, emb_pdrop=0.0, pad_token_id=0)))


def decoder(config_cls: str, model_cls: str, fields: dict, *, batch: int = BATCH) -> Callable:
    """A decoder whose tester writes its own configuration (GPT-2, OPT, BLOOM, GPT-J...)."""
    def build():
        g = _generator()
        input_ids = ids((batch, SEQ), VOCAB, g)
        model = _model(model_cls, _config(config_cls, fields))
        return model, {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids),
                       "labels": input_ids}
    return build


def encoder(config_cls: str, model_cls: str, *, token_types: bool = True, **overrides):
    """A masked-LM encoder as BertModelTester builds it: random attention mask, token types,
    token labels in [0, 3) (its num_labels)."""
    def build():
        g = _generator()
        kwargs = {"input_ids": ids((BATCH, SEQ), VOCAB, g),
                  "attention_mask": random_attention_mask(g)}
        if token_types:
            kwargs["token_type_ids"] = ids((BATCH, SEQ), 16, g)
        kwargs["labels"] = ids((BATCH, SEQ), 3, g)
        return _model(model_cls, _config(config_cls, ENCODER, **overrides)), kwargs
    return build


def seq2seq(config_cls: str, model_cls: str, fields: dict = SEQ2SEQ, **overrides):
    """An encoder-decoder: source ids and mask, target ids as labels (shifted right inside)."""
    def build():
        g = _generator()
        source = ids((BATCH, SEQ), VOCAB, g).clamp(3)
        source[:, -1] = 2  # BartModelTester ends every source with eos
        labels = ids((BATCH, SEQ), VOCAB, g).clamp(3)
        model = _model(model_cls, _config(config_cls, fields, **overrides))
        return model, {"input_ids": source, "attention_mask": torch.ones_like(source),
                       "labels": labels}
    return build


def t5(config_cls: str, model_cls: str) -> Callable:
    """T5ModelTester: d_model 32, 2 layers, 4 heads of 8, d_ff 37, 8 buckets, dropout 0.1."""
    fields = dict(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=37, num_layers=2, num_heads=4,
                  relative_attention_num_buckets=8, dropout_rate=0.1, initializer_factor=0.002,
                  eos_token_id=1, pad_token_id=0)

    def build():
        g = _generator()
        model = _model(model_cls, _config(config_cls, fields, decoder_start_token_id=0))
        return model, {"input_ids": ids((BATCH, SEQ), VOCAB, g),
                       "attention_mask": ids((BATCH, SEQ), 2, g).clamp(max=1) | 1,
                       "labels": ids((BATCH, SEQ), VOCAB, g)}
    return build


def whisper() -> Callable:
    """WhisperModelTester: d_model 16, 2 + 2 layers, 80 mel bins by 60 frames, batch 3,
    dropout 0.1; labels of 7 tokens (the decoder's inputs, shifted right inside)."""
    fields = dict(vocab_size=200, d_model=16, encoder_layers=2, decoder_layers=2,
                  encoder_attention_heads=4, decoder_attention_heads=4, num_mel_bins=80,
                  encoder_ffn_dim=16, decoder_ffn_dim=16, dropout=0.1, attention_dropout=0.1,
                  max_source_positions=30, max_target_positions=40, bos_token_id=98,
                  eos_token_id=98, pad_token_id=0, decoder_start_token_id=85,
                  suppress_tokens=None, begin_suppress_tokens=None)

    def build():
        g = _generator()
        model = _model("WhisperForConditionalGeneration", _config("WhisperConfig", fields))
        return model, {"input_features": torch.rand(3, 80, 60, generator=g),
                       "labels": ids((3, 7), 200, g)}
    return build


def vision(config_cls: str, model_cls: str, fields: dict, *, batch: int = BATCH,
           image: int = 30, labels: int = 10) -> Callable:
    def build():
        g = _generator()
        config = _config(config_cls, fields, num_labels=labels)
        pixels = torch.randn(batch, 3, image, image, generator=g)
        return _model(model_cls, config), {"pixel_values": pixels,
                                           "labels": ids((batch,), labels, g)}
    return build


VIT = dict(image_size=30, patch_size=2, num_channels=3, hidden_size=32, num_hidden_layers=2,
           num_attention_heads=4, intermediate_size=37, hidden_act="gelu",
           hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1, encoder_stride=2)

ARCHS: dict[str, tuple[str, Callable]] = {
    # decoders
    "llama": ("decoder", causal_lm("LlamaConfig", "LlamaForCausalLM")),
    "mistral": ("decoder", causal_lm("MistralConfig", "MistralForCausalLM")),
    "qwen2": ("decoder", causal_lm("Qwen2Config", "Qwen2ForCausalLM")),
    "qwen3": ("decoder", causal_lm("Qwen3Config", "Qwen3ForCausalLM")),
    "gemma": ("decoder", causal_lm("GemmaConfig", "GemmaForCausalLM")),
    "gemma2": ("decoder", causal_lm("Gemma2Config", "Gemma2ForCausalLM")),
    "gemma3": ("decoder", causal_lm("Gemma3TextConfig", "Gemma3ForCausalLM")),
    "phi": ("decoder", causal_lm("PhiConfig", "PhiForCausalLM")),
    "phi3": ("decoder", causal_lm("Phi3Config", "Phi3ForCausalLM")),
    "olmo": ("decoder", causal_lm("OlmoConfig", "OlmoForCausalLM")),
    "olmo2": ("decoder", causal_lm("Olmo2Config", "Olmo2ForCausalLM")),
    "stablelm": ("decoder", causal_lm("StableLmConfig", "StableLmForCausalLM")),
    "starcoder2": ("decoder", causal_lm("Starcoder2Config", "Starcoder2ForCausalLM")),
    "cohere": ("decoder", causal_lm("CohereConfig", "CohereForCausalLM")),
    "granite": ("decoder", causal_lm("GraniteConfig", "GraniteForCausalLM")),
    "falcon": ("decoder", causal_lm("FalconConfig", "FalconForCausalLM")),
    "gpt_neox": ("decoder", causal_lm("GPTNeoXConfig", "GPTNeoXForCausalLM")),
    "gpt2": ("decoder", decoder("GPT2Config", "GPT2LMHeadModel", dict(
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_inner=37,
        activation_function="gelu", resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1,
        n_positions=512, pad_token_id=VOCAB - 1), batch=14)),
    "gpt_neo": ("decoder", decoder("GPTNeoConfig", "GPTNeoForCausalLM", dict(
        vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=4, intermediate_size=37,
        attention_types=[[["global", "local"], 1]], window_size=7, max_position_embeddings=512,
        resid_dropout=0.1, embed_dropout=0.1, attention_dropout=0.1), batch=14)),
    "gptj": ("decoder", decoder("GPTJConfig", "GPTJForCausalLM", dict(
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, rotary_dim=4, n_inner=37,
        n_positions=512, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0), batch=14)),
    "codegen": ("decoder", decoder("CodeGenConfig", "CodeGenForCausalLM", dict(
        vocab_size=256, n_embd=32, n_layer=2, n_head=4, rotary_dim=4, n_inner=37,
        n_positions=512, n_ctx=512, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
        batch=14)),
    "opt": ("decoder", decoder("OPTConfig", "OPTForCausalLM", dict(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=4,
        ffn_dim=4, dropout=0.1, attention_dropout=0.1, max_position_embeddings=20,
        word_embed_proj_dim=16, eos_token_id=2, pad_token_id=1, bos_token_id=0))),
    "bloom": ("decoder", decoder("BloomConfig", "BloomForCausalLM", dict(
        vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4, hidden_dropout=0.1,
        attention_dropout=0.1), batch=14)),
    # encoders
    "bert": ("encoder", encoder("BertConfig", "BertForMaskedLM")),
    "roberta": ("encoder", encoder("RobertaConfig", "RobertaForMaskedLM")),
    "xlm_roberta": ("encoder", encoder("XLMRobertaConfig", "XLMRobertaForMaskedLM")),
    "electra": ("encoder", encoder("ElectraConfig", "ElectraForMaskedLM", embedding_size=32)),
    "deberta_v2": ("encoder", encoder("DebertaV2Config", "DebertaV2ForMaskedLM",
                                      relative_attention=False, position_biased_input=True,
                                      pos_att_type=[])),
    "mpnet": ("encoder", encoder("MPNetConfig", "MPNetForMaskedLM", token_types=False,
                                 relative_attention_num_buckets=32)),
    "albert": ("encoder", encoder("AlbertConfig", "AlbertForMaskedLM", embedding_size=16,
                                  hidden_size=36, num_hidden_groups=2, num_attention_heads=6)),
    # ALBERT as published (albert-base...): one layer module run by both layers
    "albert_shared": ("encoder", encoder("AlbertConfig", "AlbertForMaskedLM", embedding_size=16,
                                         hidden_size=36, num_hidden_groups=1,
                                         num_attention_heads=6)),
    "distilbert": ("encoder", encoder("DistilBertConfig", "DistilBertForMaskedLM",
                                      token_types=False, dim=32, n_layers=2, n_heads=4,
                                      hidden_dim=37, dropout=0.1, attention_dropout=0.1,
                                      activation="gelu")),
    # encoder-decoders
    "t5": ("encoder-decoder", t5("T5Config", "T5ForConditionalGeneration")),
    "mt5": ("encoder-decoder", t5("MT5Config", "MT5ForConditionalGeneration")),
    "bart": ("encoder-decoder", seq2seq("BartConfig", "BartForConditionalGeneration")),
    "mbart": ("encoder-decoder", seq2seq("MBartConfig", "MBartForConditionalGeneration")),
    "pegasus": ("encoder-decoder", seq2seq("PegasusConfig", "PegasusForConditionalGeneration")),
    "marian": ("encoder-decoder", seq2seq("MarianConfig", "MarianMTModel")),
    "whisper": ("encoder-decoder", whisper()),
    # vision
    "vit": ("vision", vision("ViTConfig", "ViTForImageClassification", VIT)),
    "deit": ("vision", vision("DeiTConfig", "DeiTForImageClassification", VIT)),
    "swin": ("vision", vision("SwinConfig", "SwinForImageClassification", dict(
        image_size=32, patch_size=2, num_channels=3, embed_dim=16, depths=[1, 2, 1],
        num_heads=[2, 2, 4], window_size=2, mlp_ratio=2.0, drop_path_rate=0.1,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, encoder_stride=8),
        image=32)),
    "convnext": ("vision", vision("ConvNextConfig", "ConvNextForImageClassification", dict(
        num_channels=3, num_stages=4, hidden_sizes=[10, 20, 30, 40], depths=[2, 2, 3, 2],
        hidden_act="gelu", image_size=32), image=32)),
    "resnet": ("vision", vision("ResNetConfig", "ResNetForImageClassification", dict(
        num_channels=3, embedding_size=10, hidden_sizes=[10, 20, 30, 40], depths=[1, 1, 2, 1],
        hidden_act="relu"), batch=3, image=32, labels=3)),
    # mixtures of experts (batched-matmul experts, see the module's docstring)
    "mixtral": ("MoE", moe("MixtralConfig", "MixtralForCausalLM")),
    "qwen2_moe": ("MoE", moe("Qwen2MoeConfig", "Qwen2MoeForCausalLM")),
    "qwen3_moe": ("MoE", moe("Qwen3MoeConfig", "Qwen3MoeForCausalLM")),
    "olmoe": ("MoE", moe("OlmoeConfig", "OlmoeForCausalLM")),
    "granitemoe": ("MoE", moe("GraniteMoeConfig", "GraniteMoeForCausalLM")),
    "deepseek_v3": ("MoE", moe("DeepseekV3Config", "DeepseekV3ForCausalLM",
                               n_routed_experts=8, n_group=2, topk_group=1,
                               first_k_dense_replace=1)),
    "dbrx": ("MoE", dbrx()),
    # state-space models and hybrids
    "mamba": ("SSM", causal_lm("MambaConfig", "MambaForCausalLM")),
    "falcon_mamba": ("SSM", causal_lm("FalconMambaConfig", "FalconMambaForCausalLM")),
    "jamba": ("SSM", moe("JambaConfig", "JambaForCausalLM")),
    "bamba": ("SSM", causal_lm("BambaConfig", "BambaForCausalLM")),
}


def build(name: str):
    torch.manual_seed(0)
    return ARCHS[name][1]()
