"""The torch side of remat, one sub-package per job, each using only those listed before it:

- `tracing`: capture the training step as one joint forward+backward fx graph;
- `measuring`: bytes, FLOPs, times and kernel scratch of every op; the allocator reader;
- `lowering`: the measured graph as the solvers' `Problem`, sharded per data-parallel rank;
- `compiled`: run a plan as a rewritten, partitioned graph (`PlannedModule`);
- `eager`: run a plan as per-block selective checkpointing in an eager loop.

The most used names are exported here, each loaded on first use (importing one module of a
sub-package, such as the device table, then imports no other); the sub-packages export the
rest.
"""
import importlib

_EXPORTS = {
    "tracing": ("Captured", "capture", "compile_step", "default_loss", "make_backend"),
    "measuring": ("DEVICES", "Device", "device", "node_flops", "register_cpu_attention",
                  "MemoryTracker", "measure_eager", "tracking_compiler", "tracking_compilers",
                  "Profile", "profile"),
    "lowering": ("lower", "op_nodes", "phases"),
    "compiled": ("Partition", "partition", "partition_fn", "PlannedModule", "planned_module",
                 "StepMeasurement", "measure_step", "time_step"),
}
_WHERE = {name: package for package, names in _EXPORTS.items() for name in names}

__all__ = [name for names in _EXPORTS.values() for name in names]


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(importlib.import_module(f"remat.fx_passes.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'remat.fx_passes' has no attribute {name!r}")
