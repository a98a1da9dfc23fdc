"""A Llama-style decoder (RMSNorm, rotary embeddings, SwiGLU MLP), and planning 7B without weights.

``python examples/llama.py`` captures, profiles and lowers the 7B configuration (hidden 4096,
32 layers, 32 heads, MLP 11008, vocab 32000, sequence 4096, bf16) on meta tensors: no weight
is allocated, so it runs on a laptop; it prints the ops, parameters and bytes of the problem.
``--layers``/``--seq``/``--batch`` shrink it.
"""
from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 32000
    hidden: int = 4096
    layers: int = 32
    heads: int = 32
    mlp: int = 11008
    kv_heads: int | None = None  # grouped-query attention: fewer key/value heads (None: heads)
    seq: int = 4096
    rope_theta: float = 10000.0
    eps: float = 1e-5
    dropout: float = 0.0  # after attention and after the MLP, as GPT-2 and the tests have it


LLAMA_7B = LlamaConfig()
# Llama 3 70B's shape: grouped-query attention with 8 key/value heads, vocabulary 128256.
LLAMA_70B = LlamaConfig(vocab_size=128256, hidden=8192, layers=80, heads=64, kv_heads=8,
                        mlp=28672, rope_theta=500000.0)
LLAMA_TINY = LlamaConfig(vocab_size=256, hidden=64, layers=2, heads=4, mlp=172, seq=32)
# The eager-mode and distributed tests' model: the architecture FSDP2 users train, with dropout.
LLAMA_TEST = LlamaConfig(vocab_size=96, hidden=32, layers=2, heads=2, mlp=88, seq=16,
                         dropout=0.1)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        # Normalize in fp32 as Llama does, whatever the activation dtype.
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * y.to(x.dtype)


def rotary(seq: int, head_dim: int, theta: float, device) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim)
    angles = torch.outer(torch.arange(seq, device=device).float(), inv)
    return angles.cos(), angles.sin()


def apply_rotary(x, cos, sin):
    cos, sin = cos[:, None, :], sin[:, None, :]  # (seq, 1, head_dim / 2) against the heads
    x1, x2 = x[..., ::2], x[..., 1::2]
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return out.flatten(-2).type_as(x)


class Attention(nn.Module):
    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.heads, self.head_dim = c.heads, c.hidden // c.heads
        self.kv_heads = c.kv_heads or c.heads
        kv = self.kv_heads * self.head_dim
        self.wq = nn.Linear(c.hidden, c.hidden, bias=False)
        self.wk = nn.Linear(c.hidden, kv, bias=False)
        self.wv = nn.Linear(c.hidden, kv, bias=False)
        self.wo = nn.Linear(c.hidden, c.hidden, bias=False)

    def forward(self, x, cos, sin):
        b, s, h = x.shape
        q = self.wq(x).view(b, s, self.heads, self.head_dim)
        k, v = (w(x).view(b, s, self.kv_heads, self.head_dim) for w in (self.wk, self.wv))
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        gqa = {"enable_gqa": True} if self.kv_heads != self.heads else {}
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True, **gqa)
        return self.wo(y.transpose(1, 2).reshape(b, s, -1))  # -1: h / N under tensor parallel


class SwiGLU(nn.Module):
    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.w1 = nn.Linear(c.hidden, c.mlp, bias=False)
        self.w3 = nn.Linear(c.hidden, c.mlp, bias=False)
        self.w2 = nn.Linear(c.mlp, c.hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class DecoderLayer(nn.Module):
    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.attention_norm = RMSNorm(c.hidden, c.eps)
        self.attention = Attention(c)
        self.ffn_norm = RMSNorm(c.hidden, c.eps)
        self.feed_forward = SwiGLU(c)
        # No dropout module at all by default: the graph of Llama as released has none.
        self.drop = nn.Dropout(c.dropout) if c.dropout else nn.Identity()

    def forward(self, x, cos, sin):
        x = x + self.drop(self.attention(self.attention_norm(x), cos, sin))
        return x + self.drop(self.feed_forward(self.ffn_norm(x)))


class Llama(nn.Module):
    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.config = c
        self.tok_embeddings = nn.Embedding(c.vocab_size, c.hidden)
        self.layers = nn.ModuleList([DecoderLayer(c) for _ in range(c.layers)])
        self.norm = RMSNorm(c.hidden, c.eps)
        self.output = nn.Linear(c.hidden, c.vocab_size, bias=False)

    def forward(self, tokens, targets):
        c = self.config
        cos, sin = rotary(tokens.shape[1], c.hidden // c.heads, c.rope_theta, tokens.device)
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x, cos, sin)
        logits = self.output(self.norm(x))
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def llama(config: LlamaConfig = LLAMA_TINY, *, batch: int = 1, device="cpu",
          dtype=torch.float32, data_seed: int | None = None):
    """(model, (tokens, targets)) on `device` ("meta" allocates nothing). The weights are the
    same on every call; the tokens are zeros, or drawn from a generator seeded `data_seed`."""
    torch.manual_seed(0)
    with torch.device(device):
        model = Llama(config).to(dtype).train()
    shape = (batch, config.seq)
    if data_seed is None or device == "meta":
        tokens = torch.zeros(shape, dtype=torch.long, device=device)
        targets = torch.zeros(shape, dtype=torch.long, device=device)
    else:
        g = torch.Generator().manual_seed(data_seed)
        tokens = torch.randint(0, config.vocab_size, shape, generator=g).to(device)
        targets = torch.randint(0, config.vocab_size, shape, generator=g).to(device)
    return model, (tokens, targets)


def tiny_llama(config: LlamaConfig = LLAMA_TEST, batch: int = 4):
    """The tests' small Llama (dropout on, random tokens): a CPU runs its step in milliseconds."""
    return llama(config, batch=batch, data_seed=1)


def tiny():
    """A factory for `remat plan examples/llama.py:tiny`: the tiny configuration, batch 8."""
    return llama(LLAMA_TINY, batch=8)


def seven_b():
    """A factory for `remat plan examples/llama.py:seven_b`: 7B on meta tensors, bf16."""
    return llama(LLAMA_7B, batch=1, device="meta", dtype=torch.bfloat16)


def seventy_b():
    """A factory for `remat plan examples/llama.py:seventy_b`: Llama 3 70B's shape on meta
    tensors, bf16, sequence 4096, batch 1."""
    return llama(LLAMA_70B, batch=1, device="meta", dtype=torch.bfloat16)


def main(argv=None) -> None:
    from remat.fx_passes import capture, lower
    from remat.solvers import make_schedule, simulate

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=LLAMA_7B.layers)
    parser.add_argument("--seq", type=int, default=LLAMA_7B.seq)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--target", default="h100")
    args = parser.parse_args(argv)
    config = replace(LLAMA_7B, layers=args.layers, seq=args.seq)
    model, inputs = llama(config, batch=args.batch, device="meta", dtype=torch.bfloat16)
    start = time.perf_counter()
    captured = capture(model, inputs, name=f"llama-{args.layers}L")
    problem = lower(captured, target=args.target)
    elapsed = time.perf_counter() - start
    save_all = make_schedule(problem, [])
    saved = simulate(problem, save_all)
    activations = sum(problem.ops[v].size for v in save_all.saved)
    gb = 1e9
    print(f"Llama config: {config}")
    print(f"parameters: {captured.param_count / 1e9:.3f} B, {captured.param_bytes / gb:.2f} GB "
          f"({captured.dtype}, device {captured.device})")
    print(f"joint graph: {len(captured.graph.nodes)} nodes; problem: {len(problem)} ops "
          f"({problem.num_forward} forward)")
    print(f"step FLOPs: {problem.total_flops / 1e12:.1f} TFLOP; roofline time on "
          f"{problem.source['target']}: {problem.total_cost:.2f} s")
    print(f"bytes saved for the backward (save all): {activations / gb:.1f} GB; "
          f"save-all activation peak: {saved.peak / gb:.1f} GB")
    print(f"capture+profile+lower: {elapsed:.0f} s")


if __name__ == "__main__":
    import os
    import sys

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    main()
