"""The models of `peers.py`, at two sizes: full (a CPU step takes about a second) and quick.

Each builder returns a `Case`: the model in training mode, its inputs (the model returns the
loss), its repeated blocks, and whether the blocks form a chain (which Chen's segments need).
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from _peers_strategies import Case


class _LMLoss(nn.Module):
    """A transformers causal LM whose forward returns the loss of predicting its own tokens."""

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=input_ids, labels=input_ids, use_cache=False).loss


def gpt2(layers: int, quick: bool) -> Case:
    from transformers import GPT2Config, GPT2LMHeadModel

    hidden, seq, batch = (64, 64, 2) if quick else (256, 256, 4)
    config = GPT2Config(n_layer=layers, n_embd=hidden, n_head=4, n_positions=seq,
                        vocab_size=2048 if quick else 8192, resid_pdrop=0.1, embd_pdrop=0.1,
                        attn_pdrop=0.1, bos_token_id=0, eos_token_id=0,
                        attn_implementation="sdpa")
    torch.manual_seed(0)
    lm = GPT2LMHeadModel(config)
    lm.loss_type = "ForCausalLM"  # else a logging call in the loss lookup breaks dynamo's graph
    model = _LMLoss(lm).train()
    ids = torch.randint(0, config.vocab_size, (batch, seq))
    return Case(f"gpt2-{layers}", model, (ids,), list(lm.transformer.h), chain=True, hf=lm)


def _tests_models():
    import tests.models as models  # the repository's test models, at benchmark sizes here

    return models


def _inputs(*shapes_and_kinds) -> tuple:
    g = torch.Generator().manual_seed(1)
    return tuple(torch.randn(*shape, generator=g) if kind == "randn"
                 else torch.randint(0, kind, shape, generator=g)
                 for shape, kind in shapes_and_kinds)


def mlp(quick: bool) -> Case:
    width, depth, batch = (128, 8, 512) if quick else (512, 16, 4096)
    torch.manual_seed(0)
    model = _tests_models().MLPChain(width, depth).train()
    inputs = _inputs(((batch, width), "randn"), ((batch, width), "randn"))
    return Case("mlp", model, inputs, list(model.layers), chain=True)


def resnet(quick: bool) -> Case:
    widths, batch, size = ((8, 16, 32), 4, 32) if quick else ((32, 64, 128, 256), 16, 64)
    torch.manual_seed(0)
    model = _tests_models().ResNet(widths=widths).train()
    inputs = _inputs(((batch, 3, size, size), "randn"), ((batch,), 10))
    return Case("resnet-bn", model, inputs, list(model.layers), chain=True)


def unet(quick: bool) -> Case:
    channels, batch, size = ((8, 16, 32), 2, 32) if quick else ((32, 64, 128, 256), 4, 128)
    torch.manual_seed(0)
    model = _tests_models().UNet(channels=channels).train()
    inputs = _inputs(((batch, 1, size, size), "randn"), ((batch, 1, size, size), "randn"))
    # Skip connections cross the blocks: per-block checkpointing applies, Chen's chain does not.
    return Case("unet", model, inputs, [*model.down, *model.merge], chain=False)


def llama(quick: bool) -> Case:
    import importlib.util
    import os
    import sys

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        "examples", "llama.py")
    spec = importlib.util.spec_from_file_location("_peers_llama", path)
    example = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = example  # dataclasses look their module up there
    spec.loader.exec_module(example)
    config = (example.LlamaConfig(vocab_size=512, hidden=64, layers=4, heads=4, mlp=172, seq=64)
              if quick else
              example.LlamaConfig(vocab_size=4096, hidden=256, layers=8, heads=8, mlp=688,
                                  seq=256))
    batch = 2 if quick else 4
    model, _ = example.llama(config, batch=batch)
    # The example's inputs are zeros (it plans shapes); a benchmark wants a real loss.
    inputs = _inputs(((batch, config.seq), config.vocab_size), ((batch, config.seq),
                                                                 config.vocab_size))
    return Case("llama", model, inputs, list(model.layers), chain=True)


MODELS: dict[str, Callable[[bool], Case]] = {
    "mlp": mlp,
    "resnet-bn": resnet,
    "unet": unet,
    "llama": llama,
    "gpt2-6": lambda quick: gpt2(6, quick),
    "gpt2-12": lambda quick: gpt2(12, quick),
}
