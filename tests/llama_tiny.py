"""A tiny Llama-style decoder with dropout (RMSNorm, rotary embeddings, SwiGLU, SDPA), for the
eager-mode and distributed tests: the architecture FSDP2 users train, at a size a CPU runs in
milliseconds. ``tiny_llama()`` returns ``(model, (tokens, targets))`` like tests/models.py."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class TinyLlamaConfig:
    vocab: int = 96
    hidden: int = 32
    layers: int = 2
    heads: int = 2
    mlp: int = 88
    seq: int = 16
    dropout: float = 0.1


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def rotate(x, cos, sin):
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class Layer(nn.Module):
    def __init__(self, c: TinyLlamaConfig):
        super().__init__()
        self.heads = c.heads
        self.attention_norm, self.ffn_norm = RMSNorm(c.hidden), RMSNorm(c.hidden)
        self.wqkv = nn.Linear(c.hidden, 3 * c.hidden, bias=False)
        self.wo = nn.Linear(c.hidden, c.hidden, bias=False)
        self.w1 = nn.Linear(c.hidden, c.mlp, bias=False)
        self.w3 = nn.Linear(c.hidden, c.mlp, bias=False)
        self.w2 = nn.Linear(c.mlp, c.hidden, bias=False)
        self.drop = nn.Dropout(c.dropout)

    def forward(self, x, cos, sin):
        b, s, h = x.shape
        q, k, v = self.wqkv(self.attention_norm(x)).view(b, s, 3, self.heads, -1).unbind(2)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True)
        x = x + self.drop(self.wo(y.transpose(1, 2).reshape(b, s, h)))
        z = self.ffn_norm(x)
        return x + self.drop(self.w2(F.silu(self.w1(z)) * self.w3(z)))


class TinyLlama(nn.Module):
    def __init__(self, c: TinyLlamaConfig):
        super().__init__()
        self.config = c
        self.embed = nn.Embedding(c.vocab, c.hidden)
        self.layers = nn.ModuleList([Layer(c) for _ in range(c.layers)])
        self.norm = RMSNorm(c.hidden)
        self.output = nn.Linear(c.hidden, c.vocab, bias=False)

    def forward(self, tokens, targets):
        c = self.config
        half = c.hidden // c.heads // 2
        inv = 1.0 / 10000 ** (torch.arange(half, device=tokens.device).float() / half)
        angles = torch.outer(torch.arange(tokens.shape[1], device=tokens.device).float(), inv)
        cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return F.cross_entropy(self.output(self.norm(x)).flatten(0, 1), targets.flatten())


def tiny_llama(config: TinyLlamaConfig = TinyLlamaConfig(), batch: int = 4):
    torch.manual_seed(0)
    model = TinyLlama(config).train()
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, config.vocab, (batch, config.seq), generator=g)
    targets = torch.randint(0, config.vocab, (batch, config.seq), generator=g)
    return model, (tokens, targets)
