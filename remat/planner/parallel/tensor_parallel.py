"""`plan_tensor_parallel`: an eager plan for one tensor-parallel rank of a model parallelized with
DTensor (`parallelize_module`: ColwiseParallel, RowwiseParallel, SequenceParallel), applied to
the parallelized model's blocks on every rank.

Planning needs no running job: parallelize the model on a fake process group of the job's size
(`fake_tensor_parallel(size)`, torch's `FakeStore`), or on the real one, and plan it like any
model. What the rank holds is read from the parallelized model itself:
- the parameters: each DTensor counts its local shard (`remat.planner.job.training.named_shapes`),
  so the state is what the placements leave the rank;
- the activations: the captured step is the rank's own (AOTAutograd traces DTensor down to
  local tensors), so a sharded activation has its shard's bytes and a replicated one, such as
  the all-gathered input of the attention under sequence parallelism, its whole bytes;
- the collectives of the step (all-reduce of a row-parallel output; all-gather and
  reduce-scatter under sequence parallelism; their backward counterparts) are ops of the
  captured graph with their output buffers (`_c10d_functional`).

What a recomputation communicates again: a checkpointed block that recomputes runs its
forward's collectives again (DTensor redistributes again; eager selective checkpointing sees
the collectives as ops of the block and re-issues them unless it caches their outputs). So
here the block's collectives are recomputable ops, which the plan caches or recomputes like any
other, and `TensorParallelPlan.recommunicated` is the bytes its recomputations send again.

Corrections: ``wait_tensor`` returns the collective's output itself (an alias, not new bytes).
A gradient larger than its parameter's shard (a row-sharded embedding's, torch 2.13: eager and
compiled alike compute it over the whole vocabulary, and eager keeps it as the `.grad`'s local
tensor) is state of that size; under FSDP2, which reduce-scatters it into the shard, the
gradient is sized as the shard (measured).

No checkpoint is a plan here: where the step with no block checkpointed fits the budget, the
plan wraps nothing (`plan_eager_mode(no_checkpoint=True)`). A selective policy that recomputes
nothing holds more than that, all the more under sequence parallelism (docs/parallelism.md).
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Any, Sequence

from remat.errors import RematError
from remat.planner.job.budget import parse_size
from remat.planner.plans.eager_plan import EagerPlan, plan_eager_mode
from remat.planner.job.tensor_layout import PARALLELIZE_FIRST, check_tensor_parallel
from remat.planner.job.training import Training
from remat.solvers import SolverOptions, Strategy
from remat.solvers.core.problem import Kind, Problem, Reason

log = logging.getLogger(__name__)

__all__ = ["TensorParallelPlan", "fake_tensor_parallel", "plan_tensor_parallel",
           "prepare_tensor_parallel"]


@dataclasses.dataclass
class TensorParallelPlan:
    """An eager plan for a tensor-parallel rank (`plan`, a
    `remat.planner.plans.eager_plan.EagerPlan`: its peak, memory, recompute, report). `apply(model)`
    wraps the parallelized model's blocks (after `parallelize_module`); `plan.block_policies` go to
    every rank of the job."""

    plan: EagerPlan
    placements: dict[str, str]
    """Parameter name -> its DTensor placements, in the model planned."""

    def apply(self, model: Any):
        from remat.fx_passes.eager.apply import apply_eager

        return apply_eager(model, self.plan.block_policies)

    @property
    def block_policies(self) -> dict:
        return self.plan.block_policies

    def __getattr__(self, name: str):
        # The rest of an EagerPlan (report, schedule, activation_peak, ...), so that
        # remat.optimize's answer for a DTensor model reads like any eager plan.
        if name.startswith("__") or "plan" not in self.__dict__:
            raise AttributeError(name)
        return getattr(self.__dict__["plan"], name)

    @property
    def peak(self) -> int:
        return self.plan.peak

    @property
    def memory(self):
        return self.plan.memory

    @property
    def recompute_flops(self) -> int:
        return self.plan.recompute_flops

    @property
    def collectives(self) -> list[tuple[str, str, int]]:
        """(op, phase, bytes of its output) of each collective of the rank's step."""
        return [(op.name, op.phase.value, op.size) for op in self.plan.eager_problem.ops
                if _collective(op)]

    @property
    def recommunicated(self) -> int:
        """Bytes the plan's recomputations communicate again (their collectives' outputs)."""
        problem = self.plan.eager_problem
        return sum(problem.ops[v].size for v in self.plan.schedule.recomputed
                   if _collective(problem.ops[v]))


def _collective(op) -> bool:
    return op.target.startswith("_c10d_functional.") and "wait_tensor" not in op.target


@contextlib.contextmanager
def fake_tensor_parallel(size: int, rank: int = 0):
    """A fake process group of `size` ranks, this process being `rank`, and a 1-D CPU device
    mesh over it (yielded): parallelize a model on it to plan one rank without a job. Refused
    when a process group is already running (plan there on the real one)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RematError("fake_tensor_parallel: a process group is already initialized; "
                         "parallelize on its mesh and plan there")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=size)
    try:
        yield init_device_mesh("cpu", (size,))
    finally:
        dist.destroy_process_group()


def plan_tensor_parallel(model: Any, budget: int | str | None = None, *,
                         activation_budget: int | str | None = None,
                         example_inputs: Sequence[Any] = (),
                         example_kwargs: dict[str, Any] | None = None,
                         training: Training = Training(), target: str = "h100",
                         solver: Strategy | str = Strategy.OPTIMAL,
                         solver_options: SolverOptions | None = None,
                         blocks: Sequence[str] | None = None,
                         prepared: Any = None, loss_fn: Any = None,
                         returns: str = "output") -> TensorParallelPlan:
    """The eager plan of least recompute whose step fits `budget` (whole step, per rank) or
    whose activations fit `activation_budget`, for one rank of `model` parallelized with
    DTensor (module doc). `example_inputs` are one rank's inputs, as the model takes them.
    Data parallelism over other ranks (FSDP2 x TP) is `training`'s (data_parallel,
    zero_stage), applied to the rank's shards. `prepared`: `prepare_tensor_parallel`'s step,
    to plan it at another budget without capturing it again. `remat.optimize(model, ...,
    execution="eager")` comes here for a DTensor model; `training.tensor_parallel` and
    `training.sequence_parallel`, where stated, are checked against the model
    (`remat.planner.job.tensor_layout`)."""
    if (budget is None) == (activation_budget is None):
        raise ValueError("give exactly one of budget= and activation_budget=")
    whole = None if budget is None else parse_size(budget)
    activations = None if activation_budget is None else parse_size(activation_budget,
                                                                    allow_zero=True)
    if prepared is None:
        prepared = prepare_tensor_parallel(model, example_inputs, example_kwargs=example_kwargs,
                                           training=training, target=target, loss_fn=loss_fn,
                                           returns=returns)
    placements = _placements(model, training)
    plan = plan_eager_mode(model, prepared, budget=whole, activation_budget=activations,
                           target=target, solver=solver, solver_options=solver_options,
                           blocks=blocks, example_inputs=example_inputs,
                           example_kwargs=example_kwargs, no_checkpoint=True)
    out = TensorParallelPlan(plan, placements)
    log.info("tensor-parallel plan: %d collectives, %d bytes communicated again",
             len(out.collectives), out.recommunicated)
    return out


def _placements(model: Any, training: Training = Training()) -> dict[str, str]:
    layout = check_tensor_parallel(model, training)
    if not layout.parallel:
        raise RematError("plan_tensor_parallel: the model has no DTensor parameter; "
                         + PARALLELIZE_FIRST.format(size="N")
                         + "; a model that is not tensor-parallel: plan it with remat.optimize")
    return layout.placements


def prepare_tensor_parallel(model: Any, example_inputs: Sequence[Any] = (), *,
                            example_kwargs: dict[str, Any] | None = None,
                            training: Training = Training(), target: str = "h100",
                            returns: str = "output", loss_fn: Any = None):
    """The rank's step captured and lowered once (`remat.planner.plans.prepare.prepare`), with the
    corrections of the module doc: plan it at any budget with `plan_tensor_parallel`."""
    from remat.planner.plans.prepare import prepare

    _placements(model, training)
    prepared = prepare(model, example_inputs, example_kwargs=example_kwargs, training=training,
                       target=target, returns=returns, loss_fn=loss_fn)
    return _eager_tensor_parallel(prepared, model)


def _eager_tensor_parallel(prepared, model) -> Any:
    """The prepared step with the block collectives recomputable and the gradients sized as
    eager makes them (module doc)."""
    from remat.fx_passes.lowering.lower import parameter_gradients

    problem = prepared.problem
    if prepared.sharded is not None and prepared.sharded.problem is not prepared.sharded.graph:
        graph = prepared.sharded.graph
    else:
        graph = problem
    local = {}
    for name, p in model.named_parameters():
        t = p.to_local() if hasattr(p, "to_local") else p
        local[name] = t.numel() * t.element_size()
    grads = parameter_gradients(prepared.captured)
    by_name = {op.name: i for i, op in enumerate(graph.ops)}
    resize = {}
    for primal, grad in grads.items():
        name = prepared.captured.params.get(primal)
        if name is None or grad not in by_name:
            continue
        root = graph.root[by_name[grad]]
        if graph.ops[root].size > local.get(name, graph.ops[root].size):
            resize[graph.ops[root].name] = local[name]

    # Eager keeps the larger gradient as .grad (its local tensor is the whole vocabulary's):
    # state, unless FSDP2 reduce-scatters it into the shard (measured).
    sharded_grads = prepared.training.zero_stage >= 2
    excess = sum(graph.ops[by_name[g]].size - b for g, b in resize.items())

    def fixed(p: Problem) -> Problem:
        ops = []
        for op in p.ops:
            if op.not_recomputable is Reason.COLLECTIVE and op.target.startswith(
                    "_c10d_functional."):
                op = dataclasses.replace(op, not_recomputable=None)
                if "wait_tensor" in op.target:  # returns its input: an alias, no bytes
                    op = dataclasses.replace(op, kind=Kind.VIEW, size=0, temp=0)
            if sharded_grads and op.name in resize:
                op = dataclasses.replace(op, size=resize[op.name])
            ops.append(op)
        return dataclasses.replace(p, ops=tuple(ops))

    new_graph = fixed(graph)
    new_problem = new_graph if problem is graph else fixed(problem)
    sharded = dataclasses.replace(prepared.sharded, problem=new_problem, graph=new_graph)
    state = prepared.state
    if not sharded_grads and excess:
        state = dataclasses.replace(state, gradients=state.gradients + excess)
    out = dataclasses.replace(prepared, problem=new_problem, sharded=sharded, state=state)
    return out
