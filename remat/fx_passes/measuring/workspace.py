"""A workspace model: kernel scratch per op family, for graphs that cannot run (meta capture).

When the weights live on the meta device no op can run, so `scratch.py` cannot ask the
allocator. `workspace_bytes(node)` then predicts the scratch from the shapes alone, with one
formula per op family. Each coefficient is the **largest** ratio measured on the CPU (torch
2.13, oneDNN, 2 threads; `benchmarks/allocator_peak.py --calibrate` reprints the
measurements), so the model errs high: a plan made with it may hold less than it claims, never
more, on the kernels it was calibrated on. Families and how they were calibrated:

| family | scratch | calibration |
| --- | --- | --- |
| convolution (forward) | 2.2 x (input + output), channels padded to 16 | 144 shapes: N 2/8, C_in 3/16/64, C_out 16/64/128, H 16/56, k 1/3, stride 1/2; max 2.17, median 0.80 |
| convolution_backward | 2.0 x (grad_output + input, channels padded to 16, + 2 x weight) | same 144 shapes; max 2.00, median 1.00 |
| native_dropout | 1.0 x input (the mask is drawn in the input's dtype, then cast to bool) | test models: exactly 1.0 |
| native_dropout_backward | 1.0 x grad_output + 16 (the product before scaling) | test models: exactly 1.0 (+12) |
| native_batch_norm_backward | 1.0 x input | test models: exactly 1.0 |
| mse_loss | 1.0 x input + 16 (the unreduced buffer, storage.py) | test models: exactly 1.0 (+12) |
| _softmax, _safe_softmax | 0.26 x input | test models: 0.258 |
| native_layer_norm_backward | 4.0 x weight (per-thread partial sums of the weight and bias gradients) | test models: exactly 4.0 at 2 threads |
| native_batch_norm (training forward) | 2.0 x weight (per-channel statistics) | test models: exactly 2.0 |
| SDPA flash (CPU) forward | 0.65 x query | 4 shapes, 2 threads: max 0.64 (per-thread blocks) |
| SDPA flash (CPU) backward | 2.05 x query | 4 shapes, 2 threads: max 2.00 |
| rng_state (remat's snapshot) | the snapshot's bytes (get_state's copy, then the clone) | exact |
| anything else that runs | 16 bytes (matmuls and pointwise ops measured 0, or a 0-dim scalar of 8 to 12 bytes that the kernel wraps a Python number in) | test models |

Limits, stated plainly: the SDPA and convolution scratch grows with the thread count and the
shapes' blocking; on CUDA, cuDNN and cuBLAS choose their workspaces at run time and this
CPU-calibrated model does not know them. Capture with real tensors (on the device that will
train) to have the scratch measured instead.
"""
from __future__ import annotations

import math
from typing import Any, Callable

import torch
from torch import fx

from remat.fx_passes.tracing.rng import rng_state, unwrapped

__all__ = ["FAMILIES", "SCALAR_BYTES", "workspace_bytes"]


def _bytes(value: Any) -> int:
    if not isinstance(value, torch.Tensor):
        return 0
    return value.numel() * value.element_size()


def _padded(value: Any, multiple: int = 16) -> int:
    """Bytes of a (N, C, ...) tensor with C rounded up to oneDNN's channel block."""
    if not isinstance(value, torch.Tensor) or value.dim() < 2:
        return _bytes(value)
    channels = value.shape[1]
    padded = math.ceil(channels / multiple) * multiple if channels else 0
    return value.numel() // max(channels, 1) * padded * value.element_size()


def _val(node: fx.Node, index: int) -> Any:
    _, args = unwrapped(node)
    arg = args[index] if index < len(args) else None
    return arg.meta.get("val") if isinstance(arg, fx.Node) else None


def _output(node: fx.Node) -> Any:
    value = node.meta.get("val")
    return value[0] if isinstance(value, (tuple, list)) else value


def _convolution(node: fx.Node) -> int:
    return math.ceil(2.2 * (_padded(_val(node, 0)) + _padded(_output(node))))


def _convolution_backward(node: fx.Node) -> int:
    grad, inputs, weight = _val(node, 0), _val(node, 1), _val(node, 2)
    return math.ceil(2.0 * (_padded(grad) + _padded(inputs) + 2 * _bytes(weight)))


def _times(index: int, factor: float, extra: int = 0) -> Callable[[fx.Node], int]:
    return lambda node: math.ceil(factor * _bytes(_val(node, index))) + extra


def _snapshot(node: fx.Node) -> int:
    return _bytes(node.meta.get("val"))


# Keyed by the ATen op's name without namespace and overload ("convolution_backward").
FAMILIES: dict[str, Callable[[fx.Node], int]] = {
    "convolution": _convolution,
    "convolution_backward": _convolution_backward,
    "native_dropout": _times(0, 1.0),
    "native_dropout_backward": _times(0, 1.0, 16),
    "native_batch_norm_backward": _times(1, 1.0),
    "mse_loss": _times(0, 1.0, 16),
    "_softmax": _times(0, 0.26),
    "_safe_softmax": _times(0, 0.26),
    "native_layer_norm_backward": _times(5, 4.0),  # the weight (None without an affine)
    "_native_batch_norm_legit_functional": _times(1, 2.0),
    "_native_batch_norm_legit": _times(1, 2.0),
    "native_batch_norm": _times(1, 2.0),
    "_scaled_dot_product_flash_attention_for_cpu": _times(0, 0.65),
    "_scaled_dot_product_flash_attention_for_cpu_backward": _times(1, 2.05),
}


def _family(target: Any) -> str:
    schema = getattr(target, "_schema", None)
    return schema.name.split("::")[-1] if schema is not None else ""


# What a kernel outside the families may allocate: a 0-dim tensor for a Python scalar.
SCALAR_BYTES = 16


def workspace_bytes(node: fx.Node) -> int:
    """The modelled scratch of one call_function node that runs (views and getitems, which
    allocate nothing, are never asked)."""
    target, _ = unwrapped(node)
    if target is rng_state:
        return _snapshot(node)
    formula = FAMILIES.get(_family(target))
    return int(formula(node)) if formula is not None else SCALAR_BYTES
