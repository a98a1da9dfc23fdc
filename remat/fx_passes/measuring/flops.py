"""FLOPs of ATen ops, from PyTorch's own formula registry (``torch.utils.flop_counter``).

The registry counts matrix multiplications, convolutions and attention; pointwise ops, norms
and softmax count zero, as in ``FlopCounterMode``, so a problem's total equals what
``FlopCounterMode`` reports for the same step. The CPU attention kernels have no formula in
PyTorch; `register_cpu_attention` gives them the CUDA kernels' convention (causal masks are
not discounted) so that attention counts the same on every device; it also gives
``torch._grouped_mm`` (MoE experts' matmuls, torchtitan's among them), which PyTorch 2.13 counts
as zero, two FLOPs per multiply-add. It changes the global registry, which is the point:
``FlopCounterMode`` then agrees with us on a CPU too.
"""
from __future__ import annotations

import logging
from typing import Any

import torch
from torch import fx
from torch.utils import flop_counter
from torch.utils._python_dispatch import TorchDispatchMode

from remat.fx_passes.tracing.rng import unwrapped

log = logging.getLogger(__name__)

__all__ = ["FlopCounter", "grouped_mm_flops", "node_flops", "register_cpu_attention"]

_registered = False


def register_cpu_attention() -> None:
    global _registered
    if _registered:
        return
    _registered = True
    aten = torch.ops.aten
    forward = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    backward = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
    registry = flop_counter.flop_registry
    if forward is not None and forward not in registry:
        @flop_counter.register_flop_formula(forward)
        def _cpu_flash_forward(query, key, value, *args, out_shape=None, **kwargs) -> int:
            return flop_counter.sdpa_flop_count(query, key, value)

    if backward is not None and backward not in registry:
        @flop_counter.register_flop_formula(backward)
        def _cpu_flash_backward(grad_out, query, key, value, *args, out_shape=None,
                                **kwargs) -> int:
            return flop_counter.sdpa_backward_flop_count(grad_out, query, key, value)

    grouped = getattr(aten, "_grouped_mm", None)
    if grouped is not None and grouped not in registry:
        flop_counter.register_flop_formula(grouped)(grouped_mm_flops)


def grouped_mm_flops(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    """``torch._grouped_mm(a, b, offs=...)``: every output element is one dot product over the
    contracted dimension, whichever operand the groups split. (M, K) x (G, K, N) -> (M, N) and
    (G, M, K) x (K, N) -> (M, N): the groups split the rows or the columns; (G, M, K) x
    (G, K, N): a batch; (M, K) x (K, N) -> (G, M, N): the groups split K, which they share out
    (a weight's gradient). Rows past the last offset are counted as computed."""
    if len(a_shape) == 2 and len(b_shape) == 2:
        return 2 * a_shape[0] * a_shape[1] * b_shape[1]
    rows = a_shape[0] if len(a_shape) == 2 else a_shape[1]
    batch = a_shape[0] if len(a_shape) == 3 and len(b_shape) == 3 else 1
    return 2 * batch * rows * a_shape[-1] * b_shape[-1]


def _val(arg: Any) -> Any:
    return arg.meta.get("val") if isinstance(arg, fx.Node) else arg


def node_flops(node: fx.Node) -> int:
    """The FLOPs of one call_function node, computed from its inputs' fake values."""
    register_cpu_attention()
    target, args = unwrapped(node)
    packet = getattr(target, "overloadpacket", None)
    formula = flop_counter.flop_registry.get(packet)
    if formula is None:
        return 0
    args = torch.fx.node.map_aggregate(args, _val)
    kwargs = torch.fx.node.map_aggregate(node.kwargs, _val)
    try:
        return int(formula(*args, out_val=node.meta.get("val"), **kwargs))
    except Exception:  # a formula that cannot read these arguments must not stop planning
        log.warning("no FLOP count for %s (%s)", node.name, target, exc_info=True)
        return 0


class FlopCounter(TorchDispatchMode):
    """Counts FLOPs with the same registry as ``FlopCounterMode``, running every op as it is.

    ``FlopCounterMode`` decomposes each op it has no formula for (``silu_backward`` into
    sigmoid, empty_like, fill_, sub_, mul), and the decomposed ops really allocate: a step
    measured under it holds more than the step does. This mode never
    decomposes. It counts exactly what `node_flops` counts for the graph's nodes, so a planned
    step's total equals the problem's FLOPs plus its recomputations'."""

    def __init__(self) -> None:
        super().__init__()
        register_cpu_attention()
        self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = flop_counter.flop_registry.get(func._overloadpacket)
        if formula is not None:
            self.total += int(formula(*args, **kwargs, out_val=out))
        return out
