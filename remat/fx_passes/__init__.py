"""The torch side of remat, one sub-package per job, each using only those listed before it:

- `tracing`: capture the training step as one joint forward+backward fx graph;
- `measuring`: bytes, FLOPs, times and kernel scratch of every op; the allocator reader;
- `lowering`: the measured graph as the solvers' `Problem`, sharded per data-parallel rank;
- `compiled`: run a plan as a rewritten, partitioned graph (`PlannedModule`);
- `eager`: run a plan as per-block selective checkpointing in an eager loop.

The most used names are exported here; the sub-packages export the rest.
"""
from remat.fx_passes.compiled import (Partition, PlannedModule, StepMeasurement, measure_step,
                                      partition, partition_fn, planned_module, time_step)
from remat.fx_passes.lowering import lower, op_nodes, phases
from remat.fx_passes.measuring import (DEVICES, Device, MemoryTracker, Profile, device,
                                       measure_eager, node_flops, profile,
                                       register_cpu_attention, tracking_compiler,
                                       tracking_compilers)
from remat.fx_passes.tracing import Captured, capture, compile_step, default_loss, make_backend

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
