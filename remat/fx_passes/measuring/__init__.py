"""Measuring a captured step: what every tensor holds in bytes (`storage`), what every op costs
in FLOPs (`flops`) and time (`timing`, a roofline for a `devices` entry or measured), the kernel
scratch ops allocate beyond their outputs (`scratch`, `workspace`), all written into the
nodes' meta by one pass (`profile_pass`); and the two independent readers of memory that checks
compare with: the allocator (`allocator`: profiler memory events on the CPU,
``max_memory_allocated`` on CUDA; `every_thread`: the CPU allocator's own count, which sees
the frees of a collective library's threads) and a dispatch-level tracker (`memory_tracker`).

Uses `tracing` below it. The names below are loaded on first use: the device table alone
(`devices`, what `remat --help` lists) imports no torch.
"""
import importlib

_EXPORTS = {
    "allocator": ("allocator_peak", "step_peak"),
    "devices": ("DEVICES", "Device", "device"),
    "flops": ("FlopCounter", "node_flops", "register_cpu_attention"),
    "memory_tracker": ("MemoryTracker", "measure_eager", "tracking_compiler",
                       "tracking_compilers"),
    "profile_pass": ("Profile", "profile"),
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = [name for names in _EXPORTS.values() for name in names]


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(importlib.import_module(f"remat.fx_passes.measuring.{_WHERE[name]}"),
                       name)
    raise AttributeError(f"module 'remat.fx_passes.measuring' has no attribute {name!r}")
