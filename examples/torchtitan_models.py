"""torchtitan models for examples/torchtitan_llama.py: small Llama3 and Qwen3-MoE configurations
built with torchtitan's own layer builders, and what torchtitan 0.3.0 needs to run on a CPU.
Imports torchtitan (an optional extra: pip install torchtitan==0.3.0 triton==3.8.0)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

SEQ = 64
VOCAB = 256


def cpu_patches() -> None:
    """torchtitan reads its device type at import, "cuda" on a machine without GPUs."""
    import torchtitan.distributed.parallel_dims as parallel_dims
    import torchtitan.distributed.utils as dist_utils
    import torchtitan.models.common.token_dispatcher as token_dispatcher
    import torchtitan.tools.utils as tools_utils

    for module in (tools_utils, parallel_dims, dist_utils, token_dispatcher):
        module.device_type = "cpu"
        if hasattr(module, "device_module"):
            module.device_module = torch.cpu


def llama3_config(layers: int = 4, dim: int = 64, heads: int = 4):
    """A small torchtitan Llama3 (its debug model's layout, smaller), with SDPA attention."""
    from torchtitan.models.common import (ComplexRoPE, Embedding, Linear, RMSNorm,
                                          compute_ffn_hidden_dim)
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import (_EMBEDDING_INIT, _NORM_INIT, Llama3Model,
                                          _build_llama3_layers, _output_linear_init)

    blocks = _build_llama3_layers(
        n_layers=layers, dim=dim, n_heads=heads,
        hidden_dim=compute_ffn_hidden_dim(dim, multiple_of=64),
        rope=ComplexRoPE.Config(dim=dim // heads, max_seq_len=SEQ, theta=500000,
                                scaling="llama"),
        attn_backend="flex")
    for block in blocks:  # flex attention has no backward on the CPU
        block.attention.inner_attention = ScaledDotProductAttention.Config()
    return Llama3Model.Config(
        dim=dim, vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=dim,
                                        param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=VOCAB,
                              param_init=_output_linear_init(dim)),
        layers=blocks)


def qwen3_moe_config(layers: int = 4, dim: int = 64, heads: int = 4, experts: int = 4):
    """A small torchtitan Qwen3-MoE (its MoE debug model's layout, smaller): grouped-query
    attention with q/k norms, top-2 routing over `experts` experts, SDPA attention."""
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.qwen3 import (_EMBEDDING_INIT, _LINEAR_INIT, Qwen3Model,
                                         _build_qwen3_moe_layers, _qwen3_norm)

    head_dim = dim // heads
    blocks = _build_qwen3_moe_layers(
        n_layers=layers, dim=dim, n_heads=heads, n_kv_heads=heads // 2, head_dim=head_dim,
        moe_hidden_dim=dim, num_experts=experts, top_k=2, attn_backend="flex",
        rope=CosSinRoPE.Config(dim=head_dim, max_seq_len=SEQ, theta=1000000.0),
        moe_comm_backend="standard")
    for block in blocks:
        block.attention.inner_attention = ScaledDotProductAttention.Config()
    return Qwen3Model.Config(
        vocab_size=VOCAB, dim=dim, norm=_qwen3_norm(dim),
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=dim,
                                        param_init=_EMBEDDING_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=VOCAB, param_init=_LINEAR_INIT),
        layers=blocks)


def torchtitan_model(name: str, layers: int):
    """(the model's config, torchtitan's parallelize function for it)."""
    from torchtitan.models.llama3 import parallelize_llama
    from torchtitan.models.qwen3 import parallelize_qwen3

    if name == "llama3":
        return llama3_config(layers=layers), parallelize_llama
    return qwen3_moe_config(layers=layers), parallelize_qwen3


def selective_ac_saving_cpu_attention():
    """torchtitan's selective checkpointing with the CPU's attention kernel in its save list, as
    its CUDA kernels are: what it does on a GPU (its list has no CPU kernel, so on a CPU it
    recomputes attention)."""
    from torchtitan.distributed.activation_checkpoint import SelectiveAC

    class SelectiveACSavingCPUAttention(SelectiveAC):
        @dataclass(kw_only=True, slots=True)
        class Config(SelectiveAC.Config):
            pass

        def get_save_ops(self) -> set:
            return {*super().get_save_ops(),
                    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default}

    return SelectiveACSavingCPUAttention
