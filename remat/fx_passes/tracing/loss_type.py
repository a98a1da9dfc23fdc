"""A Hugging Face model's ``loss_type`` while remat traces and runs it: named for the trace (an
unset one makes the model log a warning dynamo cannot trace), and put back exactly afterwards
(the Trainer reads it), so that planning leaves the model as it was."""
from __future__ import annotations

import contextlib

import torch

__all__ = ["loss_types_named", "unnamed_loss_types"]


def unnamed_loss_types(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules (a Hugging Face model, also inside a wrapper) whose ``loss_type`` is None."""
    return [module for module in model.modules()
            if hasattr(module, "loss_type") and getattr(module, "loss_type", None) is None]


@contextlib.contextmanager
def loss_types_named(modules: list[torch.nn.Module]):
    """Hugging Face models whose loss_type is unset warn (warning_once) and fall back to the
    causal-LM loss: dynamo cannot trace that logging call and breaks the graph there. Naming
    the fallback keeps the same loss without the warning. Put back afterwards, exactly: the
    Trainer reads loss_type to count the tokens it divides the loss by, so a model left with
    it set would train with another normalisation than the untouched model."""
    own = [("loss_type" in vars(module), module) for module in modules]  # else a class's
    for module in modules:
        module.loss_type = "ForCausalLM"
    try:
        yield
    finally:
        for had, module in own:
            if had:
                module.loss_type = None
            else:
                del module.loss_type
