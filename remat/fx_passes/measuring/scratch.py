"""Kernel scratch: the bytes an op allocates while it runs beyond its outputs (`Op.temp`).

``scratch_pass(gm, device)`` writes ``scratch`` (bytes) and ``scratch_source`` ("measured",
"model" or "none") into every call_function node's ``meta["remat"]``:
- **measured** (real capture): each op runs once alone, on real tensors of its inputs' shapes,
  strides and dtypes, and the allocator says how high it went above what was allocated before
  it; its output bytes (what the simulator already counts for the op) are taken off. On the
  CPU the allocator's events come from torch.profiler, one profile for the whole graph, each
  op delimited by two marker allocations of sizes nothing else allocates; on CUDA,
  ``max_memory_allocated`` around each op.
- **model** (meta/fake capture, no real run possible): `remat.fx_passes.measuring.workspace`'s model per
  op family, calibrated from such measurements.
Views and getitems allocate nothing and are not run. The pass restores the CPU generator
(random ops draw while measured) and draws its random inputs from a private generator.
"""
from __future__ import annotations

import logging
import operator
from typing import Any

import torch
from torch import fx

from remat.fx_passes.measuring.allocator import cpu_memory_events, paired
from remat.fx_passes.measuring.storage import remat_meta
from remat.fx_passes.measuring.workspace import workspace_bytes
from remat.fx_passes.tracing.rng import generator_offsets

log = logging.getLogger(__name__)

__all__ = ["measure_scratch", "scratch_pass"]

# Two consecutive allocations of these sizes open and close each op's window in the CPU
# allocator's events (odd sizes, so that no tensor of a real op collides with both in a row).
_MARK = (1237, 1249)
CPU = torch.device("cpu")


def _runs(node: fx.Node) -> bool:
    """Whether the op can allocate: views and getitems only alias storage that exists."""
    if node.op != "call_function" or node.target is operator.getitem:
        return False
    meta = remat_meta(node)
    return not meta.get("view_tuple") and (meta.get("alias_of") is None or meta.get("writes"))


def output_bytes(node: fx.Node) -> int:
    """The bytes the simulator counts for the op's own outputs while it runs."""
    meta = remat_meta(node)
    return int(meta.get("tuple_bytes") or (0 if meta.get("alias_of") is not None
                                           else meta.get("bytes", 0)))


def _materialize(value: Any, device: torch.device, generator: torch.Generator) -> Any:
    def make(v):
        if not isinstance(v, torch.Tensor):
            return v
        real = torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=device)
        # Filled through its whole storage: an expanded value (stride 0) cannot be written.
        flat = torch.empty(0, dtype=v.dtype, device=device).set_(real.untyped_storage())
        if v.dtype.is_floating_point:
            flat.normal_(generator=generator)
        else:
            flat.zero_()  # indices stay in range
        return real

    return torch.fx.node.map_aggregate(value, make)


def _arguments(node: fx.Node, device: torch.device, generator: torch.Generator):
    # A random op's seed and offset are CPU tensors in eager PyTorch (generator_offsets).
    real = lambda a: (_materialize(a.meta.get("val"), CPU if generator_offsets(a) else device,
                                   generator)
                      if isinstance(a, fx.Node) else a)
    return (torch.fx.node.map_aggregate(node.args, real),
            torch.fx.node.map_aggregate(node.kwargs, real))


def _mark() -> None:
    first = torch.empty(_MARK[0], dtype=torch.uint8)
    second = torch.empty(_MARK[1], dtype=torch.uint8)
    del first, second


def _windows(events: list[int], count: int) -> list[int]:
    """The peak of the running sum inside each of `count` marked windows, above its start."""
    peaks: list[int] = []
    i, n = 0, len(events)
    inside, live, peak = False, 0, 0
    while i < n:
        if i + 1 < n and events[i] == _MARK[0] and events[i + 1] == _MARK[1]:
            if inside:
                peaks.append(peak)
            inside, live, peak = not inside, 0, 0
            i += 4  # the two marker allocations and their two frees
            continue
        if inside:
            live += events[i]
            peak = max(peak, live)
        i += 1
    if len(peaks) != count:
        raise RuntimeError(f"the allocator's events hold {len(peaks)} op windows, not {count}")
    return peaks


def _measure_cpu(nodes: list[fx.Node], generator: torch.Generator) -> dict[fx.Node, int]:
    # One window per attempted op, in order; an op that fails leaves a window that is dropped.
    windows: list[fx.Node | None] = []
    with cpu_memory_events() as events:
        for node in nodes:
            try:
                args, kwargs = _arguments(node, torch.device("cpu"), generator)
            except Exception as e:  # symbolic or opaque inputs: modelled instead
                log.info("cannot materialize the inputs of %s (%s)", node.name, e)
                continue
            out, ran = None, node
            _mark()
            try:
                out = node.target(*args, **kwargs)
            except Exception as e:
                log.info("cannot run %s alone (%s): its scratch is modelled", node.name, e)
                ran = None
            _mark()
            windows.append(ran)
            del out, args, kwargs
    peaks = _windows(paired(events), len(windows))
    return {node: peak for node, peak in zip(windows, peaks) if node is not None}


def _measure_cuda(nodes: list[fx.Node], device: torch.device,
                  generator: torch.Generator) -> dict[fx.Node, int]:
    result = {}
    for node in nodes:
        try:
            args, kwargs = _arguments(node, device, generator)
            torch.cuda.synchronize(device)
            base = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
            out = node.target(*args, **kwargs)
            torch.cuda.synchronize(device)
        except Exception as e:
            log.info("cannot run %s alone (%s): its scratch is modelled", node.name, e)
            continue
        result[node] = torch.cuda.max_memory_allocated(device) - base
        del out, args, kwargs
    return result


def measure_scratch(nodes: list[fx.Node], device: torch.device | str) -> dict[fx.Node, int]:
    """Each node's allocator peak while it runs alone, above what was allocated before it
    (its outputs included). Nodes that cannot run alone are left out."""
    device = torch.device(device)
    generator = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad(), torch.random.fork_rng(devices=[device] if device.type == "cuda"
                                                else []):
        if device.type == "cuda":
            return _measure_cuda(nodes, device, generator)
        if device.type != "cpu":
            raise ValueError(f"kernel scratch is measured on the CPU or CUDA, not {device}")
        return _measure_cpu(nodes, generator)


def _value_device(gm: fx.GraphModule) -> torch.device:
    for node in gm.graph.nodes:
        value = node.meta.get("val")
        if isinstance(value, torch.Tensor):
            return value.device
    return torch.device("cpu")


def scratch_pass(gm: fx.GraphModule, *, measure: bool) -> int:
    """Write each node's scratch bytes; measured when `measure` (real tensors can be made on
    the device the graph's values live on), else from the workspace model. Returns the sum."""
    nodes = [n for n in gm.graph.nodes if _runs(n)]
    measured = measure_scratch(nodes, _value_device(gm)) if measure else {}
    runs = set(nodes)  # membership per node: a list made this pass quadratic (80 layers: 18 s)
    total = 0
    for node in gm.graph.nodes:
        meta = remat_meta(node)
        if node in measured:
            scratch, source = max(0, measured[node] - output_bytes(node)), "measured"
        elif node in runs:
            scratch, source = workspace_bytes(node), "model"
        else:
            scratch, source = 0, "none"
        meta.update(scratch=int(scratch), scratch_source=source)
        total += scratch
    return total
