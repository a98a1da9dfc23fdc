"""Which calls of a planned model the plan leaves to the model itself, and the guard on the
outputs of a call that ran without its plan.

A plan decides what the forward keeps for the backward. A call that records no autograd graph
keeps nothing for a backward, so there is nothing to plan: evaluation under ``torch.no_grad()``
or ``torch.inference_mode()``, Hugging Face's ``generate()`` (no grad), and a call in which
neither the parameters nor the tensor inputs require grad (a fully frozen model). Such calls
run the model plainly, as if no plan had been applied: no checkpoint, no op count checked
against the capture, any shapes, mode or flags (a key/value cache included).

A call that does record a graph in the other mode than the plan's (``model.eval()`` with grad
enabled, when the plan was made in train mode) also runs plainly, since dropout and BatchNorm
trace other ops there; its outputs carry `refuse_backward`'s hook, so that only a training
step (a backward through them) without its plan is refused, with the reason and the remedy.
"""
from __future__ import annotations

from typing import Any, Iterable, Iterator

import torch

from remat.errors import RematError

__all__ = ["records_graph", "refuse_backward", "wrong_mode_message"]


def records_graph(parameters: Iterable[torch.Tensor], args: tuple, kwargs: dict) -> bool:
    """Whether a call with these parameters and inputs records an autograd graph: grad is
    enabled (not under ``no_grad`` or ``inference_mode``) and a parameter or a tensor input
    requires grad."""
    if not torch.is_grad_enabled():
        return False
    if any(p.requires_grad for p in parameters):
        return True
    return any(t.requires_grad for t in _tensors((args, kwargs)))


def wrong_mode_message(planned_training: bool, now_training: bool, where: str = "") -> str:
    planned, now = ("train", "eval") if planned_training else ("eval", "train")
    call = "model.train()" if planned_training else "model.eval()"
    return (f"{where}planned in {planned} mode, but the model is in {now} mode now; call "
            f"{call} before running the plan, or plan the model again in {now} mode (for "
            f"validation, run the model under torch.no_grad(): it then runs without the plan)")


def refuse_backward(output: Any, message: str) -> Any:
    """`output` with a hook on each of its tensors that require grad: a backward through any
    of them raises RematError(`message`). The forward itself ran plainly and is returned as
    is; only training on it is refused."""

    def refuse(grad: torch.Tensor) -> None:
        raise RematError(message)

    for tensor in _tensors(output):
        if tensor.requires_grad:
            tensor.register_hook(refuse)
    return output


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    """The tensors in nested tuples, lists and dicts (a Hugging Face ModelOutput is a dict)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _tensors(item)
