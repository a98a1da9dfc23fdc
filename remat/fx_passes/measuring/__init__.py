"""Measuring a captured step: what every tensor holds in bytes (`storage`), what every op costs
in FLOPs (`flops`) and time (`timing`, a roofline for a `devices` entry or measured), the kernel
scratch ops allocate beyond their outputs (`scratch`, `workspace`), all written into the
nodes' meta by one pass (`profile`); and the two independent readers of memory that checks
compare with: the allocator (`allocator`: profiler memory events on the CPU,
``max_memory_allocated`` on CUDA) and a dispatch-level tracker (`memory_tracker`).

Uses `tracing` below it."""
from remat.fx_passes.measuring.allocator import allocator_peak, step_peak
from remat.fx_passes.measuring.devices import DEVICES, Device, device
from remat.fx_passes.measuring.flops import FlopCounter, node_flops, register_cpu_attention
from remat.fx_passes.measuring.memory_tracker import (MemoryTracker, measure_eager,
                                                      tracking_compiler, tracking_compilers)
from remat.fx_passes.measuring.profile import Profile, profile

__all__ = ["allocator_peak", "step_peak", "DEVICES", "Device", "device", "FlopCounter",
           "node_flops", "register_cpu_attention", "MemoryTracker", "measure_eager",
           "tracking_compiler", "tracking_compilers", "Profile", "profile"]
