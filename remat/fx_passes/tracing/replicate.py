"""Capture a stack of identical blocks by tracing three of them and replicating the middle one.

``capture_replicated(model, example_inputs, *, loss_fn=None, name=None) -> Captured``
    The joint graph `capture` would return for `model`, built from a capture of the model with
    its largest stack of identical blocks (a ``ModuleList`` or ``Sequential`` of at least four
    children equal in structure, parameter shapes and simple attributes) cut to three: the
    first, a middle one and the last, so that the boundaries (the embedding before the first,
    the head after the last) are traced as they are. The middle block's forward and backward
    nodes are then copied once per missing layer, in the order the full trace has them, with
    their own parameter placeholders, module paths (``layers.7.attention``) and data
    dependencies; the last traced block becomes layer N-1. Nodes are created in the full
    trace's order with the same base names, so fx names them as the full trace does
    (``mm_57``): profile and lower then run unchanged and give the very Problem of the full
    trace (tests/fx_passes/test_replicate.py checks it op by op). Capture time then does not grow
    with depth.

    The result is a `ReplicatedCapture` (a `Captured`): a graph for planning, not for running.
    Its placeholders stand for parameters of the full model, but no dynamo guard or compiled
    code ever saw most of them: a plan that runs re-captures the full graph
    (`remat.planner.optimize.Plan.apply` does).

    A stack whose blocks are equal with a period (Gemma-2's layers alternate sliding-window
    and full attention: period 2) is replicated group by group: the first, a middle and the
    last group of `period` blocks are traced, and the middle group is copied.

    Nothing is replicated, and the whole model is captured as `capture` does it, with a log
    line saying why, when: no stack of four or more equal blocks exists (a U-Net); the three
    traced blocks differ in their graphs (ops, shapes, constants or the way they read each
    other: blocks that are called with different inputs); a block mutates an input (BatchNorm
    statistics); or a node outside the blocks reads the middle block.

Assumption, which is why replication is asked for (``prepare(..., replicate=True)``) and not
automatic: the untraced blocks are called as the traced ones are (same inputs, same code
path). Attributes named in `PER_LAYER_ATTRIBUTES` (Hugging Face's ``layer_idx``, used only by
KV caches) may differ between blocks; any other differing int/float/bool/str attribute makes
the blocks unequal.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import nn

from remat.fx_passes.tracing.capture import Captured, capture
from remat.fx_passes.tracing.replicate_graph import TRACED, NotUniform, replicated_fields

log = logging.getLogger(__name__)

__all__ = ["PER_LAYER_ATTRIBUTES", "ReplicatedCapture", "capture_replicated", "find_periodic_stack",
           "find_stack", "model_sizes", "stack_period"]

PER_LAYER_ATTRIBUTES = frozenset({"layer_idx", "layer_id", "layer_index", "block_idx"})
_SIMPLE = (int, float, bool, str, type(None))


@dataclass
class ReplicatedCapture(Captured):
    """A `Captured` built by replication. block_path: the stack ("layers"); blocks: its length;
    traced_blocks: how many were traced."""

    block_path: str = ""
    blocks: int = 0
    traced_blocks: int = 0


def _signature(block: nn.Module) -> tuple:
    parts: list[Any] = []
    for name, sub in block.named_modules():
        attrs = tuple(sorted((k, v) for k, v in vars(sub).items()
                             if not k.startswith("_") and isinstance(v, _SIMPLE)
                             and k not in PER_LAYER_ATTRIBUTES))
        parts.append((name, type(sub), attrs))
    parts.extend((n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in block.named_parameters())
    parts.extend((n, tuple(b.shape), b.dtype) for n, b in block.named_buffers())
    return tuple(parts)


def find_stack(model: nn.Module) -> tuple[str, nn.Module] | None:
    """(path, container) of the stack of equal blocks with the most parameters, or None.
    Equal with a period (`stack_period`): Gemma-2's layers alternate sliding-window and
    full attention, and each pair of layers is a block."""
    found = find_periodic_stack(model)
    return None if found is None else found[:2]


def find_periodic_stack(model: nn.Module) -> tuple[str, nn.Module, int] | None:
    """(path, container, period) of the stack whose groups of `period` consecutive blocks
    are equal, with the most parameters, or None; the period is the least that holds, and a
    stack needs more than `TRACED` groups."""
    best, best_params = None, -1
    for path, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)) or len(module) <= TRACED \
                or list(module._modules) != [str(i) for i in range(len(module))]:
            continue  # too short, or children named otherwise than by their index
        period = stack_period([_signature(c) for c in module])
        if period is None:
            continue
        params = sum(p.numel() for p in module.parameters())
        if params > best_params:
            best, best_params = (path, module, period), params
    return best


def stack_period(signatures: Sequence[Any]) -> int | None:
    """The least period p such that block i equals block i mod p, p dividing the count, with
    more than `TRACED` groups of p; None where there is none."""
    count = len(signatures)
    for period in range(1, count // (TRACED + 1) + 1):
        if count % period == 0 and all(signatures[i] == signatures[i % period]
                                       for i in range(period, count)):
            return period
    return None


def capture_replicated(model: nn.Module, example_inputs: Sequence[Any] = (), *,
                       name: str | None = None, **options: Any) -> Captured:
    """See the module's docstring. Returns a plain `Captured` when nothing is replicated.
    `options` are `capture`'s (example_kwargs, loss_fn, fake_device, returns)."""
    start = time.perf_counter()
    name = name or type(model).__name__
    found = find_periodic_stack(model)
    if found is None:
        log.info("replication: %s has no ModuleList/Sequential of more than %d equal blocks; "
                 "capturing the whole model", name, TRACED)
        return capture(model, example_inputs, name=name, **options)
    path, stack, period = found
    blocks = len(stack)
    children = list(stack)
    groups = blocks // period
    kept = [*children[:period], *children[groups // 2 * period:(groups // 2 + 1) * period],
            *children[-period:]]
    short = type(stack)(*kept) if isinstance(stack, nn.Sequential) else nn.ModuleList(kept)
    with _swapped(model, path, short) as root:
        traced = capture(root, example_inputs, name=name, **options)
    try:
        fields = replicated_fields(traced, model, path, blocks, period)
        result = ReplicatedCapture(**{**fields, **model_sizes(model)}, block_path=path,
                                   blocks=blocks, traced_blocks=TRACED * period)
    except NotUniform as why:
        log.warning("replication: the blocks of %s.%s are not interchangeable (%s); capturing "
                    "the whole model", name, path or "<root>", why)
        return capture(model, example_inputs, name=name, **options)
    result.capture_time = time.perf_counter() - start
    log.info("replication: traced %d of the %d blocks of %s.%s and replicated the middle "
             "%s: %d nodes in %.1f s", TRACED * period, blocks, name, path or "<root>",
             "one" if period == 1 else f"{period}", len(result.graph.nodes),
             result.capture_time)
    return result


class _swapped:
    """Puts `short` where the stack at `path` is (the root itself when `path` is empty)."""

    def __init__(self, model: nn.Module, path: str, short: nn.Module):
        self.model, self.path, self.short = model, path, short

    def __enter__(self) -> nn.Module:
        if not self.path:
            return self.short
        parent_path, _, self.attr = self.path.rpartition(".")
        self.parent = self.model.get_submodule(parent_path)
        self.original = self.parent._modules[self.attr]
        self.parent._modules[self.attr] = self.short
        return self.model

    def __exit__(self, *exc) -> None:
        if self.path:
            self.parent._modules[self.attr] = self.original


def model_sizes(model: nn.Module) -> dict:
    """The parameter, buffer and dtype fields of `Captured` for the whole model."""
    unique = {p.untyped_storage()._cdata if p.device.type != "meta" else id(p): p
              for p in model.parameters()}
    dtypes: dict[torch.dtype, int] = {}
    for p in unique.values():
        dtypes[p.dtype] = dtypes.get(p.dtype, 0) + p.numel() * p.element_size()
    return {"param_count": sum(p.numel() for p in unique.values()),
            "param_bytes": sum(dtypes.values()),
            "buffer_bytes": sum(b.numel() * b.element_size() for b in model.buffers()),
            "dtype": str(max(dtypes, key=dtypes.get)).replace("torch.", "") if dtypes else ""}
