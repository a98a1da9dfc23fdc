"""`optimize(model, budget=...)`: capture -> profile -> lower -> solve -> simulate -> rewrite.

Each step is its own function of the fx_passes and solvers packages; this module only composes
them, in two halves that `sweep` reuses: `prepare` (capture, profile, lower, the state; once
per model and batch) and `plan_prepared` (solve, simulate, report; once per budget).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

from remat.errors import BudgetError, RematError
from remat.fx_passes.measuring.devices import device as target_device
from remat.planner.job.budget import parse_size
from remat.planner.plans.eager_plan import check_no_cache, plan_eager_mode
from remat.planner.plans.plan import Plan, plan_prepared
from remat.planner.plans.prepare import prepare, warn_eval_mode
from remat.planner.plans.shapes import plan_range
from remat.planner.job.training import Training
from remat.solvers import SolverOptions, Strategy
from remat.solvers.core.collector import frozen_heap

__all__ = ["optimize"]


@frozen_heap()  # what exists before planning stays out of the collector's scans
def optimize(model: Any, budget: int | str | None = None, *,
             activation_budget: int | str | None = None, example_inputs: Sequence[Any] = (),
             example_kwargs: dict[str, Any] | None = None,
             training: Training = Training(), target: str = "h100",
             solver: Strategy | str = Strategy.OPTIMAL,
             solver_options: SolverOptions | None = None,
             loss_fn: Callable | None = None, returns: str = "output",
             execution: str = "compiled", blocks: Sequence[str] | None = None,
             offload: bool = False, dynamic: dict | None = None,
             dynamic_dims: dict | None = None, compile: bool = False) -> Plan:
    """The plan of least recompute time (least FLOPs with ``SolverOptions(objective="flops")``)
    whose whole training step fits `budget` ("60GB",
    "60GiB", an int of bytes), or whose activations alone fit `activation_budget`; exactly one
    of the two. `example_inputs` is one micro-batch; `target` the device whose speed the cost
    model uses; `solver` a `Strategy` (the exact CP-SAT solver by default). Raises BudgetError
    (the smallest budget that fits, the dominant term and its remedy) when nothing fits.

    The step planned is ``model(*example_inputs, **example_kwargs)`` (one micro-batch; a
    Hugging Face model takes ``example_kwargs={"input_ids": ..., "labels": ...}``), then its
    loss: the output if it is a tensor, else its ``.loss`` / ``["loss"]`` / first element,
    or ``loss_fn(output)``; it must be a floating scalar. Floating inputs must have the
    parameters' dtype. The plan is made in the model's current mode (`Plan.training_mode`);
    a model in eval mode (as ``from_pretrained`` returns it) is planned so, with a warning.
    `returns`: what `Plan.module` returns ("output": what the model returns, see there).
    `execution="eager"` plans for per-block selective checkpointing in an eager loop
    (FSDP2, DDP): `model = plan.apply(model)` wraps the blocks (the repeated children, or the
    modules named in `blocks`) in place; see `remat.planner.plans.eager_plan`. It refuses,
    before capturing anything, a Hugging Face model whose forward would build a key/value
    cache (use_cache=True on a config that builds one: `cache_configs`). A model
    tensor-parallelized with DTensor (`parallelize_module`) is planned per TP rank, in
    execution="eager" only (`remat.planner.parallel.tensor_parallel`: a `TensorParallelPlan`), its
    sharding read from its placements and checked against `Training(tensor_parallel=...,
    sequence_parallel=...)`; `Training(tensor_parallel=N > 1)` with a model that has no
    DTensor parameter is refused (parallelize it first). `offload=True` lets
    the plan keep saved values in host memory between the forward and the backward (at most
    `Training.host_memory` bytes), their transfers on copy streams beside the compute over the
    target's host link (`Device.host_link`), costed by what the step waits for them
    (`remat.solvers.timeline.overlap`). Compiled execution: the solver's rich model and offload
    search decide (`SolverOptions(model="rich"|"auto")`); eager execution: the block inputs that
    checkpoint saves, through saved-tensor hooks (`remat.solvers.timeline.eager_offload`).
    Offload plans fixed shapes (not with `dynamic=`).

    `dynamic={"batch": (1, 8), "seq": (8, 128)}` plans one plan for every step whose sizes
    lie in those ranges (both modes; `remat.planner.plans.shapes`): "batch" is dimension 0 of every
    tensor input and "seq" dimension 1 of those with two or more, unless `dynamic_dims`
    (``{input: {dim: name}}``) says otherwise. The budget holds at every shape of the range;
    a call outside it raises RematError before it runs. The example may have any sizes: it
    is tiled or cut to each bucket's largest shape.

    Every planned call is checked before it runs against what was planned (input names,
    dtypes and shapes, the autocast state the step was traced under, parameters' requires_grad
    and dtypes): what changed is named in a RematError. Under ``torch.autocast`` the plan is
    made for the autocast graph and runs under the same autocast only.

    `compile=True` (execution="compiled"): `plan.module` runs the planned step through
    Inductor, fused and compiled, instead of op by op. The plan is accepted on the allocator's
    reading of one compiled step on the example inputs, made on the model (real weights) and
    put back as it was; the reading is the plan's activation peak, and where it is over the
    budget the plan is made again with room for the excess
    (`remat.planner.plans.inductor_check`). Recomputations are planned just before their
    readers (``SolverOptions(free_positions=False)``), where Inductor's fused step reads the
    most predictably, and the least recompute FLOPs is the objective (``objective="flops"``,
    seconds breaking ties): Inductor fuses a recomputed pointwise op into its reader, so what
    costs time is what costs FLOPs. Where it fuses one into every reader, the recomputation
    costs nothing and holds no memory in the plan, and a saved one whose inputs the plan saves
    anyway is recomputed instead (docs/execution-model.md, "Fused recomputations"). A plan
    file keeps the choice.

    `compile=True` with execution="eager": the eager plan is accepted on the allocator's
    reading of ``torch.compile(plan.apply(model))`` (torch.compile's defaults, Inductor's
    configuration as it stands at the call), made on the model and unwrapped again; the
    reading is the plan's peak, made again with room for the excess as above, and
    `plan.module` is that compiled model. Train with ``torch.compile(plan.apply(model))``.
    ``compile="blocks"`` reads instead each block of the applied model compiled on its own
    (``block.compile()``, torchtitan's per-block compile; then ``fully_shard`` as usual): a
    graph per block, so ``torch._dynamo.config.recompile_limit`` must be at least the number
    of blocks (else a RematError says so). Each reading starts and ends with
    ``torch._dynamo.reset()``.
    `plan.compile_blocks(model)` (remat's own partitioner per block) is neither."""
    if execution not in ("compiled", "eager"):
        raise ValueError(f"execution must be \"compiled\" or \"eager\", not {execution!r}")
    if compile not in (False, True, "blocks"):
        raise ValueError(f"compile must be False, True or \"blocks\", not {compile!r}")
    if compile == "blocks" and execution != "eager":
        raise ValueError("compile=\"blocks\" reads an eager plan with each block compiled "
                         "(execution=\"eager\"); a compiled plan compiles its whole step: "
                         "compile=True")
    if blocks is not None and execution != "eager":
        raise ValueError("blocks= names the modules to checkpoint in execution=\"eager\"")
    whole, activations = _one_budget(budget, activation_budget)
    if offload and dynamic is not None:
        # Host buffers (pinned, allocated ahead) and the eager hooks' matching are sized by
        # the planned shapes; a range's buckets are not.
        raise ValueError("offload=True plans fixed shapes: its host buffers and transfers are "
                         "sized for the example's; plan without dynamic=, or without offload")

    if compile:
        from remat.planner.plans.inductor_check import check_compile_setup
        from remat.planner.plans.prepare import has_meta_weights

        check_compile_setup(dynamic=dynamic, offload=offload, training=training,
                            meta_weights=has_meta_weights(model))
    warn_eval_mode(model, "remat.optimize")
    if execution == "eager":  # refused before the capture, not after the planning
        check_no_cache(model, "remat.optimize(..., execution=\"eager\")")

    from remat.planner.job.tensor_layout import check_tensor_parallel

    if check_tensor_parallel(model, training).parallel:
        return _plan_tensor_parallel(model, whole, activations, example_inputs, example_kwargs,
                                     training, target, solver, solver_options, loss_fn,
                                     returns, execution, blocks, offload, dynamic, compile)

    def plan_one(example_inputs, example_kwargs, shape_range=None) -> Plan:
        options = solver_options
        if compile:  # fused recomputations, just before their readers: see inductor_check
            options = dataclasses.replace(options or SolverOptions(), free_positions=False,
                                          objective="flops")
        # Inductor's own forms of the joint graph are what remat's compiled step runs; an
        # eager plan's blocks run the model's own ops, matched op for op at each call.
        prepared = prepare(model, example_inputs, example_kwargs=example_kwargs,
                           training=training, target=target, loss_fn=loss_fn, returns=returns,
                           shape_range=shape_range,
                           inductor=compile and execution == "compiled")
        if offload:
            prepared = prepared.with_host_link(target_device(target).host_link,
                                               training.host_memory)

        def solved(allowance_cut: int = 0, *, least: bool = False,
                   fallback: bool = True) -> Plan:
            def made(chosen):
                if execution == "eager":
                    plan = plan_eager_mode(model, prepared, budget=whole,
                                           activation_budget=activations, target=target,
                                           solver=solver, solver_options=chosen, blocks=blocks,
                                           example_inputs=example_inputs,
                                           example_kwargs=example_kwargs,
                                           allowance_cut=allowance_cut,
                                           # the model compiled with no block
                                           # wrapped is plain torch.compile: taken
                                           # where the allowance holds its eager peak
                                           no_checkpoint=compile is True,
                                           for_compile=bool(compile))
                    plan.compile = compile  # how step_reading compiles the applied model
                    return plan
                return plan_prepared(model, prepared, budget=whole,
                                     activation_budget=activations, target=target,
                                     solver=solver, solver_options=chosen,
                                     allowance_cut=allowance_cut)

            if not least:
                return remembered(allowance_cut, options, made)
            # The plan of the least simulated peak, read under Inductor, is the least a
            # BudgetError names: made in deterministic mode, the same plan (and reading) comes
            # back when that figure is asked for, where the same least peak is found again.
            # Deterministic mode searches less (one worker): where it finds no plan at that
            # peak, the wall-clock search's stands (`fallback`).
            chosen = options
            if options is None or options.deterministic is None:
                chosen = dataclasses.replace(options or SolverOptions(), deterministic=True)
            try:
                return remembered(allowance_cut, chosen, made)
            except BudgetError:
                if not fallback or chosen is options:
                    raise
                return remembered(allowance_cut, options, made)

        # Each solve made once: the least-peak search asked again in the options' own mode
        # (deterministic set by the caller) is the solve already made.
        solves: dict = {}

        def remembered(allowance_cut: int, chosen: Any, made: Callable[[Any], Plan]) -> Plan:
            key = (allowance_cut, None if chosen is None else chosen.deterministic)
            if key not in solves:
                try:
                    solves[key] = made(chosen)
                except BudgetError as e:
                    solves[key] = e
            if isinstance(solves[key], BudgetError):
                raise solves[key]
            return solves[key]

        if not compile:
            return solved()
        from remat.planner.plans.inductor_check import compiled_plan

        args = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) \
            else (example_inputs,)

        def cut_to(smallest: int) -> int:  # the cut that leaves what `smallest` would
            if whole is None:
                return activations - smallest
            return prepared.allowance(whole) - prepared.allowance(smallest)

        return compiled_plan(model, solved, cut_to, args, dict(example_kwargs or {}))

    if dynamic is None:
        if dynamic_dims is not None:
            raise ValueError("dynamic_dims= names the input dimensions of the sizes in dynamic=")
        return plan_one(example_inputs, example_kwargs)
    args = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) \
        else (example_inputs,)
    return plan_range(model, dynamic, dynamic_dims, args, dict(example_kwargs or {}), plan_one,
                      execution)


def _plan_tensor_parallel(model, whole, activations, example_inputs, example_kwargs, training,
                          target, solver, solver_options, loss_fn, returns, execution, blocks,
                          offload, dynamic, compile):
    """A DTensor model: one TP rank's eager plan (`plan_tensor_parallel`); what is not
    supported for it is refused, with what to do instead."""
    from remat.planner.parallel.tensor_parallel import plan_tensor_parallel

    if execution != "eager":
        raise RematError(
            "a compiled plan of a tensor-parallel (DTensor) model is not supported: plan it "
            "with remat.optimize(model, ..., execution=\"eager\"), which plans one TP rank, "
            "and apply it to the parallelized model with plan.apply(model)")
    if compile:
        raise RematError(
            "compile=True measures the compiled step in this process, which holds one TP "
            "rank's shards and runs no other rank's collectives: plan a tensor-parallel model "
            "with compile=False, apply the plan and compile the model yourself (its compiled "
            "memory is then not predicted)")
    if offload or dynamic is not None:
        raise RematError(
            "offload=True and dynamic= are not supported for a tensor-parallel (DTensor) "
            "model: plan it at fixed shapes without offload")
    return plan_tensor_parallel(model, whole, activation_budget=activations,
                                example_inputs=example_inputs, example_kwargs=example_kwargs,
                                training=training, target=target, solver=solver,
                                solver_options=solver_options, blocks=blocks,
                                loss_fn=loss_fn, returns=returns)


def _one_budget(budget, activation_budget) -> tuple[int | None, int | None]:
    if (budget is None) == (activation_budget is None):
        raise ValueError("give exactly one of budget= (the whole step, e.g. \"60GB\") and "
                         "activation_budget= (the activations alone)")
    if budget is not None:
        return parse_size(budget), None
    return None, parse_size(activation_budget, allow_zero=True)
