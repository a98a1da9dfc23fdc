"""A Hugging Face model's loss settings while remat traces and runs it.

``loss_type``: named for the trace (an unset one makes the model log a warning dynamo cannot
trace), and put back exactly afterwards (the Trainer reads it), so that planning leaves the
model as it was.

``config.problem_type``: a classification head whose configuration leaves it None sets it at
its first call, from its number of labels and the labels' dtype. Compiled, that first call
is traced with None (dynamo guards on it) and the assignment replayed after it, so the second
call fails the guard and compiles the whole step again: twice the compile time, and the
compile's own small allocations (24 bytes on Swin) inside the second step's memory. The
compiled step sets it before its first call, as the model itself would have, so that one
compile serves every call."""
from __future__ import annotations

import contextlib

import torch

__all__ = ["loss_types_named", "problem_types_settled", "unnamed_loss_types",
           "unset_problem_types"]


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


# transformers' classification losses that set config.problem_type on their first call
_SETS_PROBLEM_TYPE = ("ForSequenceClassification", "ForImageClassification",
                      "ForVideoClassification", "ForAudioClassification")


def unset_problem_types(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The classification heads of `model` that set ``config.problem_type`` at their first
    call: a head (its own ``num_labels``) whose configuration leaves it None and whose loss is
    transformers' classification loss, or whose forward sets it itself (most heads of
    transformers' models)."""
    import inspect

    heads = []
    for module in model.modules():
        config = getattr(module, "config", None)
        if "num_labels" not in vars(module) or config is None or \
                getattr(config, "problem_type", "") is not None:
            continue
        try:
            source = inspect.getsource(type(module).forward)
        except (OSError, TypeError):
            source = ""
        if getattr(module, "loss_type", None) in _SETS_PROBLEM_TYPE or \
                "config.problem_type =" in source:
            heads.append(module)
    return heads


def problem_types_settled(heads: list[torch.nn.Module], kwargs: dict) -> None:
    """Set each head's ``config.problem_type`` still None from the call's ``labels`` as
    transformers' rule does on the first call (one label: regression; integer labels:
    single-label classification; else multi-label). Left set, as after an eager call."""
    labels = kwargs.get("labels")
    if not isinstance(labels, torch.Tensor):
        return  # no loss in this call: the model reads no problem type
    for head in heads:
        config = head.config
        if config.problem_type is not None:
            continue
        if head.num_labels == 1:
            config.problem_type = "regression"
        elif head.num_labels > 1 and labels.dtype in (torch.long, torch.int):
            config.problem_type = "single_label_classification"
        else:
            config.problem_type = "multi_label_classification"
