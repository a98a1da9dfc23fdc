"""The torch side: capture the joint graph, profile it, lower it to a Problem, measure memory."""
from remat.fx_passes.capture import Captured, capture, compile_step, default_loss, make_backend
from remat.fx_passes.devices import DEVICES, Device, device
from remat.fx_passes.flops import node_flops, register_cpu_attention
from remat.fx_passes.lower import lower, op_nodes, phases
from remat.fx_passes.memory_tracker import (MemoryTracker, measure_eager, tracking_compiler,
                                            tracking_compilers)
from remat.fx_passes.measure import StepMeasurement, measure_step, time_step
from remat.fx_passes.planned import PlannedModule, planned_module
from remat.fx_passes.profile import Profile, profile
from remat.fx_passes.rewrite import Partition, partition, partition_fn

__all__ = [
    "Captured", "capture", "compile_step", "default_loss", "make_backend",
    "DEVICES", "Device", "device",
    "node_flops", "register_cpu_attention",
    "lower", "op_nodes", "phases",
    "MemoryTracker", "measure_eager", "tracking_compiler", "tracking_compilers",
    "Profile", "profile",
    "Partition", "partition", "partition_fn", "PlannedModule", "planned_module",
    "StepMeasurement", "measure_step", "time_step",
]
