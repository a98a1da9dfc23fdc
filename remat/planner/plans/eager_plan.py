"""`optimize(..., execution="eager")`: a plan that runs as per-block selective checkpointing in
the user's own eager loop (FSDP2, DDP, Hugging Face), and `EagerPlan.apply`, which wraps the
model's blocks in place.

The plan is made for what the eager mode holds (`remat.solvers.timeline.eager`): the exact
solver's plan for the compiled mode is one seed among others (checkpoint every block whole, cache
everything cacheable), each repaired until its eager peak fits and improved while it does;
with the `optimal` strategy, that policy hints the exact search over the eager timeline
(`remat.solvers.eager.search`), whose plan is OPTIMAL or FEASIBLE with a proven gap; the
solve itself is `remat.solvers.solve_eager`.
With a host link (`offload=True`), the last share of the limit plans the policy again from its
cache with the block inputs whose transfers hide kept in host memory
(`remat.solvers.timeline.eager_offload`), taken where it costs less or only it fits (HEURISTIC).
`SolverOptions.time_limit` bounds them all together.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from functools import cached_property
from types import MappingProxyType
from typing import Any, Sequence

from remat.errors import BudgetError, RematError
from remat.planner.job.budget import format_size
from remat.planner.plans.block_compile import compile_blocks
from remat.planner.plans.gap_advice import warn_on_gap
from remat.planner.plans.solver_report import with_phases
from remat.planner.job.ranks import options_for_this_job
from remat.planner.plans.plan import Plan, budget_error_in_user_terms, state_overflow
from remat.planner.plans.prepare import (cache_configs, check_eager_device, check_same_parameters,
                                   has_meta_weights, shard_step)
from remat.solvers import SolverOptions, Strategy, solve_eager
from remat.solvers.baselines.standard import block_of
from remat.solvers.timeline.eager import eager_schedule

log = logging.getLogger(__name__)


class EagerPlan(Plan):
    """A plan for eager training: `apply(model)` wraps the model's blocks in place with
    checkpoint and a selective policy per block, and returns the model."""

    execution = "eager"

    def __init__(self, *, policies, structure, eager_problem, to_graph, **fields):
        super().__init__(**fields)
        self.policies = policies
        self.structure = structure
        self.eager_problem = eager_problem
        """The problem the eager plan was made on: the graph's ops with eager's bytes, and under
        ZeRO-2/3 the collectives; `schedule` and `structure` number its ops."""
        self.to_graph = to_graph
        """For each op of `eager_problem`, the joint-graph op it is (None: a collective)."""

    @property
    def block_policies(self) -> dict:
        """Each block's policy (picklable): plan on one rank, send these to the others and
        call `remat.fx_passes.eager.apply.apply_eager(model, policies)` there. For a plan made
        for a range of shapes, each block's policy per bucket with the planned call's checks
        (`guarded_policies`)."""
        return self._plain_policies() if self.shapes is None else self.guarded_policies

    def _plain_policies(self) -> dict:
        from remat.fx_passes.eager.block_policy import with_cache, with_offload

        cached = frozenset(self.to_graph[v] for v in self.schedule.info["cached"])
        mode = self.prepared.captured.training  # a block in the other mode runs plainly
        # A plan read under torch.compile lets Inductor's partitioner fuse cached pointwise
        # ops into their backward readers (BlockPolicy.prefer_save).
        policies = {p: dataclasses.replace(with_cache(pol, cached), training=mode,
                                           prefer_save=self.compile is not False)
                    for p, pol in self.policies.items()}
        for path, (inputs, prefetch) in self._offloads().items():
            policies[path] = with_offload(policies[path], inputs, prefetch)
        return policies

    @property
    def guarded_policies(self) -> dict:
        """Each block's policy for each bucket of the planned shapes, with the planned call's
        spec: `apply_eager` then checks every training call before it runs
        (remat.fx_passes.eager.call_guard)."""
        from remat.fx_passes.eager.call_guard import GuardedPolicy
        from remat.fx_passes.eager.runs import module_path

        plans = self.shapes.plans if self.shapes is not None else {None: self}
        tables = {bucket: plan._plain_policies() for bucket, plan in plans.items()}
        spec = dataclasses.replace(self.prepared.call_spec, scalars_free=True,
                                   device_index=False)
        # A run of a shared module (``path#k``) is guarded as the module it runs.
        return {name: GuardedPolicy(module_path(name),
                                    tuple((b, t[name]) for b, t in tables.items()), spec)
                for name in self.policies}

    def _offloads(self) -> dict[str, tuple[list, list]]:
        """Per block: the (shape, dtype) of the inputs it offloads, and the blocks whose
        offloaded inputs load when it unpacks its own (`remat.solvers.timeline.eager_offload`)."""
        from remat.fx_passes.lowering.lower import op_nodes
        from remat.solvers.timeline.eager_blocks import block_runs
        from remat.solvers.timeline.eager_offload import offloadable

        schedule, problem = self.schedule, self.eager_problem
        if not schedule.offload_at:
            return {}
        runs = block_runs(problem, self.structure, schedule.info["cached"])
        eligible = offloadable(problem, self.structure, runs)
        at_trigger = {run.trigger: run.name for run in runs if run.trigger is not None}
        nodes = op_nodes(self.prepared.captured, self.prepared.sharded.graph)
        plans: dict[str, tuple[list, list]] = {}
        for s, load in sorted(schedule.offload_at.items()):
            block, val = eligible[s], nodes[self.to_graph[s]].meta["val"]
            plans.setdefault(block, ([], []))[0].append((tuple(val.shape), str(val.dtype)))
            ahead = plans.setdefault(at_trigger[load], ([], []))[1]
            if block not in ahead:
                ahead.append(block)
        return plans

    def offload_timeline(self):
        from remat.solvers.timeline.eager import eager_transfers

        return self.eager_problem, eager_transfers(self.eager_problem, self.structure,
                                                   self.schedule)

    @cached_property
    def module(self):
        """The model handed to `optimize` with the plan applied (`apply`, in place); for a plan
        made with compile=True, ``torch.compile`` of it, and with compile="blocks" the model
        with each block compiled in place: the step its peak was read on."""
        applied = Plan.module.func(self)
        if not self.compile:
            return applied
        from remat.planner.plans.step_reading import compile_applied, compiled_blocks

        return compile_applied(applied, compiled_blocks(self))

    def apply(self, model: Any):
        from remat.fx_passes.eager.apply import apply_eager

        check_same_parameters(model, self.prepared.param_shapes)
        if has_meta_weights(model):
            raise RematError("plan.apply(model) needs real weights; this model's parameters are "
                             "meta or fake tensors: load or initialize the weights first")
        check_eager_device(model, self.prepared.captured.device)
        check_no_cache(model)
        policies = (self._plain_policies() if self.prepared.call_spec is None
                    else self.guarded_policies)
        return apply_eager(model, policies)

    def compile_blocks(self, model: Any, *, inductor: bool = False):
        """The plan applied by compiling each block with remat's partitioner (torchtitan's
        per-block compile) instead of wrapping it in checkpoint: see
        `remat.planner.plans.block_compile.compile_blocks`."""
        if self.shapes is not None:
            raise RematError("compile_blocks compiles each block for the planned shapes only; "
                             "a plan for a range of shapes (dynamic=) runs with "
                             "plan.apply(model)")
        return compile_blocks(self, model, inductor=inductor)


def plan_eager_mode(model: Any, prepared, *, budget: int | None, activation_budget: int | None,
                    target: str, solver: Strategy | str, solver_options: SolverOptions | None,
                    blocks: Sequence[str] | None, example_inputs: Sequence[Any] | None = None,
                    example_kwargs: dict[str, Any] | None = None, no_checkpoint: bool = False,
                    allowance_cut: int = 0, for_compile: bool = False):
    """The eager plan of least recompute within the budget: a selective-checkpoint policy for
    every block. `no_checkpoint`: where the step with no block checkpointed fits, that is
    the plan (no policy, nothing recomputed; `unwrapped_plan`). `allowance_cut`: bytes kept
    free below the budget's allowance (the compiled step's excess, `inductor_check`).
    `for_compile`: the plan is made for torch.compile (`eager_step`)."""
    probing = time.perf_counter()
    problem, structure, policies, to_graph = eager_structure(
        model, prepared, blocks, example_inputs, example_kwargs, for_compile=for_compile)
    phases = [*prepared.phases, ("probe", time.perf_counter() - probing)]
    strategy = Strategy(solver)
    allowance = prepared.allowance(budget, activation_budget) - allowance_cut
    if allowance < 0:  # known before any solve, whatever its time limit
        raise state_overflow(prepared, budget, strategy, solver_options,
                             per_block=eager_schedule(problem, structure, ()))
    schedule = unwrapped_plan(problem, structure, allowance) if no_checkpoint else None
    if schedule is not None:  # no block wrapped: no policy
        structure, policies = structure.unwrapped(), {}
    else:
        solving = time.perf_counter()
        schedule = _solved(prepared, problem, structure, allowance, budget, strategy,
                           solver_options)
        schedule = with_phases(schedule, (*phases, ("solve", time.perf_counter() - solving)))
        warn_on_gap(schedule, log)
    # schedule.peak is the eager timeline's (eager_schedule), so the terms are the eager step's.
    memory = prepared.step_memory(schedule, budget)
    log.info("eager plan: %d blocks, activation peak %s, recompute %.3g FLOPs", len(policies),
             format_size(schedule.peak), schedule.recompute_flops)
    return EagerPlan(model=model, prepared=prepared, schedule=schedule, memory=memory,
                     target=target, solver=strategy,
                     solver_options=solver_options,
                     activation_budget=activation_budget, policies=policies,
                     structure=structure, eager_problem=problem, to_graph=to_graph)


def _solved(prepared, problem, structure, allowance: int, budget: int | None,
            strategy: Strategy, solver_options: SolverOptions | None):
    """`solve_eager`'s policy within `allowance`, a BudgetError in the user's terms if none."""
    try:
        # Limits left to None are sized by the eager problem: the solver's own, whatever the
        # capture and probe before it took.
        schedule = solve_eager(problem, structure, allowance, strategy,
                               options_for_this_job(solver_options))
    except BudgetError as e:
        raise budget_error_in_user_terms(prepared, e, budget=budget, strategy=strategy) from None
    return schedule


def unwrapped_plan(problem, structure, allowance: int):
    """The schedule of the step with no block checkpointed (`EagerBlocks.unwrapped`: eager
    autograd saves what its nodes read, nothing is recomputed) where its eager peak fits
    `allowance`, else None. Nothing costs less, and a selective policy that recomputes
    nothing holds more: it caches every value its block makes before the recomputation's
    stop, in checkpoint's frame until the block's backward, where autograd keeps what its
    nodes read (under sequence parallelism also the norms' output shards that only the
    all-gather reads, and the row-parallel outputs laid out for the reduce-scatter: 17 % and
    35 % above no checkpoint in docs/parallelism.md's GPT)."""
    from remat.solvers.core.schedule import Status
    from remat.solvers.timeline.eager import eager_schedule

    schedule = eager_schedule(problem, structure.unwrapped(), (), strategy="no checkpoint",
                              status=Status.OPTIMAL, budget=max(allowance, 0))
    if schedule.peak > allowance:
        return None
    return dataclasses.replace(schedule, bound=0.0, info=MappingProxyType(
        {**schedule.info, "model": "no checkpoint"}))


def eager_structure(model: Any, prepared, blocks: Sequence[str] | None,
                    example_inputs: Sequence[Any] | None = None,
                    example_kwargs: dict[str, Any] | None = None, *, for_compile: bool = False):
    """What the eager planner solves: the problem with eager's bytes (under ZeRO-2/3 with the
    collectives), the blocks' structure, each block's policy, and for each op of the problem
    the joint-graph op it is (None: a collective)."""
    from remat.fx_passes.eager.policy import block_paths
    from remat.fx_passes.tracing.call_checks import uncached_autocast
    from remat.fx_passes.eager.probe import probe

    paths = block_paths(model, prepared.sharded.graph, blocks, block_of)
    observed = None
    if example_inputs is not None and not prepared.meta_weights:
        # As the applied blocks run: autocast casting each weight at each use (apply.py).
        with uncached_autocast():
            observed = probe(model, _as_tuple(example_inputs), paths, example_kwargs or {})
        writers = {p: o.writes_input for p, o in observed.items() if o.writes_input}
        if writers:
            paths = _without_input_writers(paths, writers, blocks)
            with uncached_autocast():
                observed = probe(model, _as_tuple(example_inputs), paths, example_kwargs or {})
    else:
        log.info("eager: no weights to run the blocks with; their eager ops are derived from "
                 "the joint graph (plan.apply's run checks them)")
    structure, policies, problem, to_graph = eager_step(prepared, paths, observed=observed,
                                                        for_compile=for_compile)
    return problem, structure, policies, to_graph



def _without_input_writers(paths: Sequence[str], writers: dict[str, tuple],
                           blocks: Sequence[str] | None) -> list[str]:
    """The block paths less those that write in place into a tensor they are called with
    (``nn.ReLU(inplace=True)`` as a block of its own, as in a U-Net's ``nn.Sequential(conv,
    BatchNorm, ReLU(inplace=True))``): `torch.utils.checkpoint` saves a block's inputs and
    refuses them at backward once overwritten, so such a block runs without checkpoint. Found
    by default, it is left out with a warning; named in ``blocks=``, it is a RematError."""
    named = ", ".join(f"{p!r} ({writers[p][0][1]}, op {writers[p][0][0]} of the block)"
                      for p in writers)
    why = ("write in place into a tensor they are called with, which torch.utils.checkpoint "
           "saves for the backward and refuses there once overwritten")
    if blocks is not None:
        raise RematError(
            f"execution=\"eager\": blocks {named} {why}. Checkpoint modules that contain the "
            "in-place op together with the op that made its input (the enclosing module, e.g. "
            "the nn.Sequential), or make the op out of place (nn.ReLU(inplace=False))")
    kept = [p for p in paths if p not in writers]
    if not kept:
        raise RematError(
            f"execution=\"eager\": every block found ({named}) would {why.split(', which')[0]}"
            "; name the modules to checkpoint with blocks=[...] (modules that contain the "
            "in-place op together with the op that made its input), or make the op out of "
            "place (nn.ReLU(inplace=False))")
    log.warning("execution=\"eager\": blocks %s %s; they run without checkpoint. To "
                "checkpoint them, name enclosing modules with blocks=[...] or make the op out "
                "of place (nn.ReLU(inplace=False))", named, why)
    return kept


def eager_step(prepared, paths: Sequence[str], *, observed=None, policies=None, probed=None,
               for_compile: bool = False):
    """(structure, policies, eager problem, its ops' joint-graph ops) of the eager step whose
    blocks are `paths`: their policies `observed` by a probe, derived from the joint graph, or
    given (a saved plan's, `remat.planner.plans.plan_file`, with what its probe found: `probed`,
    `eager_blocks`'s, in the joint graph's numbering). `for_compile`: the plan runs under
    torch.compile, whose traced policy caches every random draw (`draws_cached`)."""
    from remat.fx_passes.eager.eager_bytes import draws_cached, eager_problem, with_eager_bytes
    from remat.fx_passes.eager.policy import eager_blocks
    from remat.fx_passes.eager.recompute_state import state_kept_recomputable
    from remat.fx_passes.lowering.lower import op_nodes

    captured, joint = prepared.captured, prepared.sharded.graph
    nodes = op_nodes(captured, joint)
    joint = state_kept_recomputable(joint, nodes)
    if for_compile:
        joint = draws_cached(joint, nodes)
    structure, policies = eager_blocks(captured, joint, paths, observed, policies=policies,
                                       probed=probed)
    # Checkpoint's recomputations run the graph's ops with eager's bytes; under ZeRO-2/3 the
    # collectives of FSDP2 are inserted among them as in the compiled mode (gathered
    # parameters, full gradients until their reduce-scatter), and the blocks renumbered.
    problem = eager_problem(joint, nodes, captured.device)
    if captured.shape_range is None:  # the probe saw one shape: a range keeps its bound
        # and one routing: a size read from the data keeps its worst case (tracing.unbacked)
        worst = {v for v, node in enumerate(nodes) if "unbacked_val" in node.meta}
        problem = with_eager_bytes(problem, policies, keep=worst)
    problem = dataclasses.replace(problem, host_bandwidth=joint.host_bandwidth,
                                  host_capacity=joint.host_capacity)
    to_graph = tuple(range(len(problem)))
    if prepared.sharded.problem is not prepared.sharded.graph:
        sharded = shard_step(problem, captured, prepared.training)
        problem, to_graph = sharded.problem, sharded.graph_index
        structure = structure.renumbered({g: i for i, g in enumerate(to_graph)
                                          if g is not None})
    return structure, policies, problem, to_graph


def check_no_cache(model: Any, where: str = "plan.apply(model)") -> None:
    """Refuse a Hugging Face model whose forward builds a key/value cache (`cache_configs`):
    its blocks append to the cache in the forward and again when checkpoint recomputes them,
    so the recomputation sees other shapes (what `gradient_checkpointing_enable()` avoids by
    turning it off). `where` names the call refused: remat.optimize refuses before it
    captures anything, plan.apply the model it is given."""
    caching = cache_configs(model)
    if caching:
        remedy = "; ".join(f"{config}.use_cache = False" for config in caching)
        raise RematError(
            f"{where}: {', '.join(caching)} {'has' if len(caching) == 1 else 'have'} "
            "use_cache=True, with which the model's forward builds a key/value cache; its "
            "checkpointed blocks would append to the cache again when recomputed. Set "
            f"{remedy} before remat.optimize (training needs no cache; a submodule may keep a "
            "config of its own, as T5's decoder does, which model.config does not reach)")


def _as_tuple(inputs: Any) -> tuple:
    return tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)

