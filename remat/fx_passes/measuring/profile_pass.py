"""Profile a captured joint graph: one pass per concern, results in ``node.meta["remat"]``.

``profile(captured, *, target="h100", measure=False, device=None) -> Profile``
runs, in order,
- `storage_pass` (remat.fx_passes.measuring.storage): ``bytes``, ``alias_of``, ``tuple_bytes``;
- `flops_pass`: ``flops`` from ``torch.utils.flop_counter``'s registry;
- `module_pass`: ``module``, the module path of the op ("h.3.attn"), backward ops included;
- `scratch_pass` (remat.fx_passes.measuring.scratch): ``scratch``, the bytes a kernel allocates while it
  runs beyond its outputs, measured by the allocator when the graph was captured with real
  tensors, else from the workspace model (``scratch_source`` says which);
- `time_pass`: ``time`` in seconds, the roofline for `target` or, with ``measure=True``, the
  median of CUDA-event timings of the op alone on ``device`` (a GPU by default; a CPU only
  when asked), ``time_source`` saying which.
The returned `Profile` holds totals and the target; per-node numbers stay in the nodes' meta.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
from torch import fx

from remat.fx_passes.tracing.capture import Captured
from remat.fx_passes.tracing.names import module_path
from remat.fx_passes.measuring.devices import Device, device as lookup_device
from remat.fx_passes.measuring.flops import node_flops
from remat.fx_passes.measuring.scratch import scratch_pass
from remat.fx_passes.measuring.storage import remat_meta, storage_pass
from remat.fx_passes.measuring.timing import measure_node, roofline

log = logging.getLogger(__name__)

__all__ = ["Profile", "flops_pass", "module_pass", "profile", "time_pass"]


@dataclass(frozen=True)
class Profile:
    target: Device
    measured: bool
    total_flops: int
    total_time: float
    profile_time: float
    scratch_measured: bool = False  # kernel scratch from the allocator, not the model


    def to_dict(self) -> dict:
        return {"target": self.target.name, "measured": self.measured,
                "total_flops": self.total_flops, "total_time": self.total_time,
                "profile_time": self.profile_time, "scratch_measured": self.scratch_measured}


def flops_pass(gm: fx.GraphModule) -> int:
    total = 0
    for node in gm.graph.nodes:
        flops = node_flops(node) if node.op == "call_function" else 0
        remat_meta(node)["flops"] = flops
        total += flops
    return total


def _stack(node: fx.Node) -> dict | None:
    return node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack")


def module_pass(gm: fx.GraphModule) -> None:
    for node in gm.graph.nodes:
        stack = _stack(node)
        path = ""
        if stack:
            qualified = list(stack.values())[-1]
            qualified = qualified[0] if isinstance(qualified, tuple) else qualified
            path = module_path(str(qualified))
        remat_meta(node)["module"] = path


def time_pass(gm: fx.GraphModule, target: Device, *, measure: bool = False,
              device: torch.device | str | None = None) -> float:
    run_on = None
    if measure:
        run_on = torch.device(device) if device is not None else torch.device("cuda")
        if run_on.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("measure=True needs a GPU (or device='cpu' to time on the CPU)")
    total = 0.0
    for node in gm.graph.nodes:
        meta = remat_meta(node)
        seconds, source = None, "roofline"
        if run_on is not None and node.op == "call_function":
            seconds = measure_node(node, run_on)
            source = "measured" if seconds is not None else "roofline"
        if seconds is None:
            seconds = roofline(node, meta.get("flops", 0), target)
        meta.update(time=seconds, time_source=source)
        total += seconds
    return total


def profile(captured: Captured, *, target: "str | Device" = "h100", measure: bool = False,
            device: torch.device | str | None = None) -> Profile:
    start = time.perf_counter()
    gm = captured.graph_module
    chip = lookup_device(target)
    storage_pass(gm)
    total_flops = flops_pass(gm)
    module_pass(gm)
    # Weights on the meta device cannot run: their ops' scratch comes from the model.
    real = captured.device != "meta"
    scratch_pass(gm, measure=real)
    total_time = time_pass(gm, chip, measure=measure, device=device)
    result = Profile(target=chip, measured=measure, total_flops=total_flops,
                     total_time=total_time, profile_time=time.perf_counter() - start,
                     scratch_measured=real)
    gm.meta["remat_profile"] = result
    log.info("profiled %s: %.3g FLOPs, %.3g s on %s", captured.model_name, total_flops,
             total_time, chip.name)
    return result
