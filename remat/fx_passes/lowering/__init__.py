"""Lowering a profiled joint graph to the solvers' `Problem` (`lower`: one `Op` per node with
its bytes, FLOPs, time, scratch and what may not be recomputed, and why), and sharding that
problem for a data-parallel rank (`sharding`: FSDP2/ZeRO's gathered parameters and
reduce-scattered gradients as ops of the step).

Uses `tracing` and `measuring` below it, and `remat.solvers`."""
from remat.fx_passes.lowering.lower import lower, op_nodes, parameter_gradients, phases
from remat.fx_passes.lowering.sharding import Sharded, project, shard

__all__ = ["lower", "op_nodes", "parameter_gradients", "phases", "Sharded", "project", "shard"]
