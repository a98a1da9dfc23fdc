"""Small, honest architectures for tests and benchmarks.

Each factory returns ``(model, example_inputs)``; ``model(*example_inputs)`` returns a scalar
loss (or, for Hugging Face GPT-2, a ModelOutput with ``.loss``). Models are in training mode,
dropout on where the architecture has it, seeded so every call builds the same weights.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


# nanoGPT (Karpathy), trimmed to what a training step runs.
@dataclass
class GPTConfig:
    block_size: int = 32
    vocab_size: int = 128
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 32
    dropout: float = 0.1
    bias: bool = True


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head, self.n_embd, self.dropout = config.n_head, config.n_embd, config.dropout

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.h = nn.ModuleList([Block(config) for _ in range(config.n_layer)])
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.wte.weight = self.lm_head.weight  # weight tying, as in GPT-2

    def forward(self, idx, targets):
        pos = torch.arange(0, idx.size(1), dtype=torch.long, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def gpt(config: GPTConfig | None = None, batch: int = 4, device="cpu"):
    config = config or GPTConfig()
    torch.manual_seed(0)
    with torch.device(device):
        model = GPT(config).train()
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, config.vocab_size, (batch, config.block_size), generator=g)
    targets = torch.randint(0, config.vocab_size, (batch, config.block_size), generator=g)
    return model, (idx.to(device), targets.to(device))


def gpt2_hf(batch: int = 4, seq: int = 32):
    """GPT-2 from transformers, built from a config (never downloaded): 2 layers, hidden 64."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=128, n_positions=64, n_embd=64, n_layer=2, n_head=2,
                        attn_implementation="sdpa")
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config).train()
    model.loss_type = "ForCausalLM"
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (batch, seq), generator=g)
    return _HFLoss(model), (ids,)


class _HFLoss(nn.Module):
    """Calls the HF model with labels = inputs, so the forward returns the output with .loss."""

    def __init__(self, model):
        super().__init__()
        self.model = model
        self.loss_type = "ForCausalLM"

    def forward(self, input_ids):
        return self.model(input_ids=input_ids, labels=input_ids)


class EncoderWithLoss(nn.Module):
    def __init__(self, d_model=64, nhead=4, layers=2, dim_ff=128, dropout=0.1):
        super().__init__()
        layer = nn.TransformerEncoderLayer(d_model, nhead, dim_ff, dropout, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, d_model)

    def forward(self, x, target):
        return F.mse_loss(self.head(self.encoder(x)), target)


def transformer_encoder(batch: int = 4, seq: int = 32, d_model: int = 64):
    torch.manual_seed(0)
    model = EncoderWithLoss(d_model).train()
    g = torch.Generator().manual_seed(1)
    return model, (torch.randn(batch, seq, d_model, generator=g),
                   torch.randn(batch, seq, d_model, generator=g))


class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride=1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                      nn.BatchNorm2d(cout))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + (x if self.down is None else self.down(x)))


class ResNet(nn.Module):
    def __init__(self, widths=(16, 32), classes=10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, widths[0], 3, 1, 1, bias=False),
                                  nn.BatchNorm2d(widths[0]), nn.ReLU())
        blocks, cin = [], widths[0]
        for i, w in enumerate(widths):
            blocks += [BasicBlock(cin, w, 1 if i == 0 else 2), BasicBlock(w, w)]
            cin = w
        self.layers = nn.Sequential(*blocks)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x, y):
        h = self.layers(self.stem(x))
        return F.cross_entropy(self.fc(h.mean((2, 3))), y)


def resnet(batch: int = 4, size: int = 32):
    torch.manual_seed(0)
    model = ResNet().train()
    g = torch.Generator().manual_seed(1)
    return model, (torch.randn(batch, 3, size, size, generator=g),
                   torch.randint(0, 10, (batch,), generator=g))


class UNet(nn.Module):
    """Long skip connections: every encoder level's output waits for its decoder level."""

    def __init__(self, channels=(8, 16, 32)):
        super().__init__()
        self.down = nn.ModuleList()
        cin = 1
        for c in channels:
            self.down.append(nn.Sequential(nn.Conv2d(cin, c, 3, padding=1), nn.ReLU(),
                                           nn.Conv2d(c, c, 3, padding=1), nn.ReLU()))
            cin = c
        self.up = nn.ModuleList()
        self.merge = nn.ModuleList()
        for c in reversed(channels[:-1]):
            self.up.append(nn.ConvTranspose2d(cin, c, 2, stride=2))
            self.merge.append(nn.Sequential(nn.Conv2d(2 * c, c, 3, padding=1), nn.ReLU()))
            cin = c
        self.out = nn.Conv2d(cin, 1, 1)

    def forward(self, x, target):
        skips = []
        for i, block in enumerate(self.down):
            x = block(x if i == 0 else F.max_pool2d(x, 2))
            skips.append(x)
        for up, merge, skip in zip(self.up, self.merge, reversed(skips[:-1])):
            x = merge(torch.cat([up(x), skip], dim=1))
        return F.mse_loss(self.out(x), target)


def unet(batch: int = 2, size: int = 32):
    torch.manual_seed(0)
    model = UNet().train()
    g = torch.Generator().manual_seed(1)
    return model, (torch.randn(batch, 1, size, size, generator=g),
                   torch.randn(batch, 1, size, size, generator=g))


class MLPChain(nn.Module):
    def __init__(self, width=256, depth=8):
        super().__init__()
        self.layers = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.GELU())
                                      for _ in range(depth)])

    def forward(self, x, target):
        return F.mse_loss(self.layers(x), target)


def mlp(batch: int = 128, width: int = 256, depth: int = 8):
    torch.manual_seed(0)
    model = MLPChain(width, depth).train()
    g = torch.Generator().manual_seed(1)
    return model, (torch.randn(batch, width, generator=g), torch.randn(batch, width, generator=g))


MODELS = {
    "gpt": gpt,
    "gpt2_hf": gpt2_hf,
    "transformer_encoder": transformer_encoder,
    "resnet": resnet,
    "unet": unet,
    "mlp": mlp,
}


# Eager-mode accuracy: ViT's attention, and ALBERT's one layer run by every layer of a step.
class Attention(nn.Module):  # ViT's attention: dropout on the probabilities, the largest tensor
    def __init__(self, d=16):
        super().__init__()
        self.qkv, self.out = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        probs = self.drop(torch.softmax(q @ k.transpose(-1, -2), dim=-1))
        return x + self.out(probs @ v)


class Shared(nn.Module):  # ALBERT: one layer module run by every layer of the step
    def __init__(self):
        super().__init__()
        self.layer = Attention()

    def forward(self, x, y):
        for _ in range(3):
            x = self.layer(x)
        return ((x - y) ** 2).mean()
