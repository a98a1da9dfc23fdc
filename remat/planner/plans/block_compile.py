"""`compile_blocks(plan, model)`: an eager plan's blocks compiled with remat's partitioner,
for training loops that compile each block and then shard it (torchtitan: `torch.compile`
per block, then `fully_shard`). The alternative to `plan.apply(model)`, which wraps the
blocks with eager checkpointing; see `remat.fx_passes.compiled.block_compile`."""
from __future__ import annotations

from typing import Any

from remat.errors import RematError
from remat.fx_passes.compiled.block_compile import BlockPlan
from remat.planner.plans.prepare import check_eager_device, check_same_parameters, has_meta_weights
from remat.solvers.core.problem import Phase

__all__ = ["block_plans", "compile_blocks"]


def compile_blocks(plan: Any, model: Any, *, inductor: bool = False) -> Any:
    """Compile each block of `model` that `plan` (made with ``execution="eager"``) names, in
    place: its forward keeps what the plan caches of the block, its backward recomputes the
    rest it needs, each just before its first use; op by op, or by Inductor with `inductor`
    (which schedules and fuses the ops itself; the saved tensors stay the plan's). Then
    `fully_shard` the blocks and the model as usual. Returns `model`;
    `model.remat_partitions[path]` lists each block's compiled graphs once it has run.

    The plan's peak (`plan.peak`) is the eager mode's, where checkpoint recomputes a block's
    uncached ops all at once; the compiled blocks recompute the same values one at a time,
    and that timeline is not simulated separately."""
    from remat.fx_passes.compiled.block_compile import compile_model_blocks

    plans = block_plans(plan)
    check_same_parameters(model, plan.prepared.param_shapes)
    if has_meta_weights(model):
        raise RematError("compile_blocks(plan, model) needs real weights; load or initialize "
                         "them first")
    check_eager_device(model, plan.prepared.captured.device)
    return compile_model_blocks(model, plans, inductor=inductor)


def block_plans(plan: Any) -> dict[str, BlockPlan]:
    """Each block's decisions (picklable): plan on one rank, send these to the others and call
    `remat.fx_passes.compiled.block_compile.compile_model_blocks(model, plans)` there."""
    if getattr(plan, "execution", None) != "eager":
        raise RematError("compile_blocks needs a plan made with execution=\"eager\" (its "
                         "decisions are per block); a compiled plan runs the whole step: use "
                         "plan.module")
    from remat.fx_passes.eager.runs import module_path, run_index

    shared = sorted({module_path(n) for n in plan.policies if run_index(n) is not None})
    if shared:
        raise RematError(f"compile_blocks: {shared[0]!r} runs several times in a step (a "
                         "shared layer), each run with its own decisions; one compiled block "
                         "cannot follow them: use plan.apply(model)")
    problem = plan.eager_problem
    cached = frozenset(plan.schedule.info["cached"])
    plans = {}
    for path in plan.policies:
        # The graph's own ops: FSDP2's collectives (to_graph None) are not in a block's code.
        members = [v for v, op in enumerate(problem.ops) if op.phase is Phase.FORWARD
                   and plan.to_graph[v] is not None
                   and (op.module == path or op.module.startswith(path + "."))]
        plans[path] = BlockPlan(path, tuple(problem.ops[v].target for v in members),
                                frozenset(k for k, v in enumerate(members) if v in cached))
    return plans
