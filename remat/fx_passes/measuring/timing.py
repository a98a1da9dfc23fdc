"""Time per op: a roofline for a target device, or a measurement.

Roofline: ``max(flops / peak(dtype), bytes moved / bandwidth) + launch overhead``, where the
bytes moved are the op's tensor inputs read plus its outputs written. Views and getitems move
nothing and launch nothing: they cost 0.

Measured (``measure=True``): every op runs on real tensors made from its fake inputs (random
floats, zero integers so that indices stay in range), a few warm-up runs and then the median
of several timed runs, with CUDA events on a GPU and ``time.perf_counter`` on a CPU.
"""
from __future__ import annotations

import logging
import operator
import statistics
import time
from typing import Any

import torch
from torch import fx

from remat.fx_passes.measuring.devices import Device
from remat.fx_passes.tracing.rng import generator_offsets

log = logging.getLogger(__name__)

__all__ = ["measure_node", "roofline"]


def _tensors(value: Any) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    torch.fx.node.map_aggregate(value, lambda v: out.append(v) if isinstance(v, torch.Tensor) else v)
    return out


def moved_bytes(node: fx.Node) -> int:
    inputs = [n.meta.get("val") for n in node.all_input_nodes]
    tensors = [t for v in inputs for t in _tensors(v)] + _tensors(node.meta.get("val"))
    return sum(t.numel() * t.element_size() for t in tensors)


def _dtype(node: fx.Node) -> str:
    tensors = [t for n in node.all_input_nodes for t in _tensors(n.meta.get("val"))]
    floats = [t.dtype for t in tensors if t.dtype.is_floating_point]
    return str(floats[0]) if floats else "float32"


def roofline(node: fx.Node, flops: int, target: Device) -> float:
    meta = node.meta.get("remat", {})
    if node.op != "call_function" or node.target is operator.getitem:
        return 0.0
    if meta.get("alias_of") is not None or meta.get("view_tuple"):
        return 0.0
    compute = flops / target.peak_flops(_dtype(node)) if flops else 0.0
    memory = moved_bytes(node) / (target.bandwidth * target.efficiency)
    return max(compute, memory) + target.launch_overhead


def _materialize(value: Any, device: torch.device) -> Any:
    def make(v):
        if not isinstance(v, torch.Tensor):
            return v
        real = torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=device)
        return real.normal_() if v.dtype.is_floating_point else real.zero_()

    return torch.fx.node.map_aggregate(value, make)


def measure_node(node: fx.Node, device: torch.device, *, runs: int = 5,
                 warmup: int = 2) -> float | None:
    """Median seconds of one op on `device`, or None when it cannot run alone."""
    if node.op != "call_function" or node.target is operator.getitem:
        return 0.0
    def real(a):  # a random op's seed and offset are CPU tensors in eager (generator_offsets)
        if not isinstance(a, fx.Node):
            return a
        return _materialize(a.meta.get("val"),
                            torch.device("cpu") if generator_offsets(a) else device)

    args = torch.fx.node.map_aggregate(node.args, real)
    kwargs = torch.fx.node.map_aggregate(node.kwargs, real)
    try:
        with torch.no_grad():
            for _ in range(warmup):
                node.target(*args, **kwargs)
            return _timed(node, args, kwargs, device, runs)
    except Exception as e:  # ops that need context (RNG offsets, symbolic sizes) fall back
        log.info("cannot time %s alone (%s): using the roofline", node.name, e)
        return None


def _timed(node, args, kwargs, device, runs) -> float:
    times = []
    if device.type == "cuda":
        for _ in range(runs):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            node.target(*args, **kwargs)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
    else:
        for _ in range(runs):
            t0 = time.perf_counter()
            node.target(*args, **kwargs)
            times.append(time.perf_counter() - t0)
    return statistics.median(times)
