"""Running a plan compiled: the joint graph rewritten by a schedule and partitioned into a
forward that saves what the plan keeps and a backward that recomputes the rest
(`joint_graph` matches the graph to its problem, `rewrite` partitions it), run as a
`PlannedModule` (`planned`) op by op or through Inductor (`inductor`); per-block compilation
of an eager plan's blocks (`block_compile`); and the measurement of a planned step under the
allocator (`measure_step`).

Uses `tracing`, `measuring` and `lowering` below it."""
from remat.fx_passes.compiled.block_compile import BlockPlan, compile_model_blocks
from remat.fx_passes.compiled.measure_step import StepMeasurement, measure_step, time_step
from remat.fx_passes.compiled.planned import PlannedModule, planned_module
from remat.fx_passes.compiled.rewrite import Partition, partition, partition_fn

__all__ = ["BlockPlan", "compile_model_blocks", "StepMeasurement", "measure_step", "time_step",
           "PlannedModule", "planned_module", "Partition", "partition", "partition_fn"]
