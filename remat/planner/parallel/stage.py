"""One pipeline stage's candidate plans and each one's memory per micro-batch.

A stage whose backward runs whole (B: GPipe, 1F1B, Interleaved1F1B, LoopedBFS; and the first
stage of the zero-bubble schedules, whose I torch skips and whose W is a whole backward) is
planned with remat's eager plans (per-block selective checkpointing), at a ladder of
activation budgets for one micro-batch: `ladder` returns them, each with its
`MicrobatchMemory` read off remat's eager timeline of the stage's step
(`remat.fx_passes.tracing.stage_step`).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Sequence

from remat.errors import BudgetError
from remat.solvers import Problem, SolverOptions, StepKind
from remat.solvers.timeline.eager import eager_holds, eager_schedule
from remat.solvers.timeline.eager_blocks import block_runs
from remat.solvers.timeline.pipeline_rank import MicrobatchMemory, Pass, passes_from_live
from remat.solvers.timeline.simulate import timeline_of

log = logging.getLogger(__name__)

__all__ = ["Candidate", "ladder", "simulated_memory"]


@dataclass(frozen=True)
class Candidate:
    """One way to run a stage: the block policies to apply (path -> BlockPolicy, paths in the
    stage module's own names; empty: no checkpoint), or the blocks to checkpoint whole
    (`whole`, split-backward stages), and its memory per micro-batch."""

    name: str
    memory: MicrobatchMemory
    policies: dict
    whole: tuple[str, ...] = ()
    cost: float = 0.0
    """Recompute seconds of one micro-batch on the target (0 where measured)."""

    @property
    def recompute_flops(self) -> int:
        return self.memory.recompute_flops


def simulated_memory(problem: Problem, blocks, cached: Sequence[int], *,
                     received_gradient: bool = False) -> MicrobatchMemory:
    """A micro-batch's passes under the eager policy caching `cached`, from remat's eager
    timeline (`remat.solvers.timeline.eager`): the forward's steps, what lives across the gap
    between the forward and the backward (the holds spanning it: the first backward step's own bytes
    are not held in the gap, nor what it starts, such as the copy of the generator's state
    that a recomputation there keeps), the backward's steps, and when each parameter gradient
    is made. `received_gradient`: a stage before the last, whose backward starts from the
    gradient the next stage sends; the captured step's `Seed` scalar (and the gradient that
    seeds it, `Problem.source["seeds"]`) stands for it, which the runtime never makes."""
    runs = block_runs(problem, blocks, cached)
    order, holds, _ = eager_holds(problem, blocks, runs)  # no offloads here
    steps = timeline_of(problem, order, holds).steps
    boundary = next(t for t, s in enumerate(steps) if s.kind is not StepKind.FORWARD)
    held = sum(size for _, size, start, stop in holds if start < boundary <= stop)
    live = [s.live for s in steps]
    if received_gradient:
        # The seed scalar is an output: held from its own step to the end of the step.
        seeds = problem.source.get("seeds", {})
        for t, s in enumerate(steps):
            op = problem.ops[s.op]
            if s.kind is StepKind.FORWARD and op.name in seeds and s.op in problem.pinned:
                live[t:] = [v - op.size for v in live[t:]]
                held -= op.size if t < boundary else 0
    roots = {problem.root[problem.index(n)] for n in problem.source.get("param_gradients", ())}
    step_of = {s.op: t for t, s in enumerate(steps) if s.kind is StepKind.BACKWARD}
    made = [(problem.ops[op].size, t, step_of[blocks.node_end.get(op, op)])
            for op, t in step_of.items() if op in roots]
    forward, backward, later, gradients = passes_from_live(live, boundary, held, made)
    schedule = eager_schedule(problem, blocks, cached)
    return MicrobatchMemory(forward=forward, backward=backward, backward_accumulating=later,
                            gradients=gradients, recompute_flops=schedule.recompute_flops)


def ladder(step_module: Any, prepared, *, levels: int, target: str,
           solver_options: SolverOptions | None, example_inputs: Sequence[Any],
           prefix: str) -> list[Candidate]:
    """Eager plans of the stage at `levels` activation budgets for one micro-batch, from
    caching every value it may to the least it can hold, with their memory; distinct plans
    only, cheapest first."""
    from remat.planner.plans.eager_plan import plan_eager_mode

    def plan(activations: int):
        return plan_eager_mode(step_module, prepared, budget=None, activation_budget=activations,
                               target=target, solver="optimal", solver_options=solver_options,
                               blocks=None, example_inputs=example_inputs)

    grads = prepared.graph_gradients  # simulated peaks count them; activation budgets not
    most = plan(10 ** 15)  # caches all it may: its problem and blocks serve every candidate
    problem, blocks = most.eager_problem, most.structure
    received = step_module.loss_fn is None  # a stage before the last (StageStep's Seed)
    none = no_checkpoint(most, received_gradient=received)
    whole = checkpoint_all(most, prefix, received_gradient=received)
    # From what no checkpointing holds at once down to what checkpointing every block does.
    high = max(none.memory.forward.peak, none.memory.backward.peak) - grads
    low = eager_schedule(problem, blocks, ()).peak - grads
    out: dict[tuple, Candidate] = {(): whole}

    def add(name: str, eager_plan) -> None:
        cached = tuple(eager_plan.schedule.info["cached"])
        if cached in out:
            return
        memory = simulated_memory(eager_plan.eager_problem, eager_plan.structure, cached,
                                  received_gradient=received)
        policies = {path.removeprefix(prefix): p for path, p in eager_plan.block_policies.items()}
        out[cached] = Candidate(name, memory, policies, cost=eager_plan.schedule.cost)

    add("remat (caches all it may)", most)
    paths = list(blocks.ops)
    partial = [checkpoint_some(most, prefix, paths[:k], received_gradient=received)
               for k in range(1, len(paths))]
    for k in range(1, levels - 1):
        activations = high - (high - low) * k // max(levels - 1, 1)
        try:
            add(f"remat (one micro-batch within {activations:,} B)", plan(activations))
        except BudgetError as e:
            log.info("stage ladder: no plan at %d bytes (%s)", activations, e)
    return _undominated([none, *partial, *out.values()])


def _undominated(candidates: list[Candidate]) -> list[Candidate]:
    """The candidates no other one beats in every pass's bytes and in recompute, cheapest
    first."""
    def key(c: Candidate) -> tuple:
        m = c.memory
        return (c.recompute_flops, m.forward.peak, m.forward.after, m.backward.peak,
                m.backward_accumulating.peak)

    def beats(a: Candidate, b: Candidate) -> bool:
        return a is not b and all(x <= y for x, y in zip(key(a), key(b))) and key(a) != key(b)

    kept = [c for c in candidates if not any(beats(o, c) for o in candidates)]
    return sorted(kept, key=key)


def no_checkpoint(eager_plan, *, received_gradient: bool = False) -> Candidate:
    """No block checkpointed: eager autograd saves what it saves (remat's eager timeline with no
    block, every forward value the backward reads saved). `received_gradient`:
    `simulated_memory`'s."""
    problem, blocks = eager_plan.eager_problem, eager_plan.structure
    return Candidate("no checkpoint", simulated_memory(problem, blocks.unwrapped(), (),
                                                       received_gradient=received_gradient),
                     {}, cost=0.0)


def checkpoint_some(eager_plan, prefix: str, paths: Sequence[str], *,
                    received_gradient: bool = False) -> Candidate:
    """The blocks at `paths` checkpointed whole, the others not at all (Megatron's "recompute
    k layers"): remat's eager timeline with only those blocks."""
    from dataclasses import replace

    from remat.fx_passes.eager.block_policy import with_cache

    problem, blocks = eager_plan.eager_problem, eager_plan.structure
    chosen = set(paths)
    some = replace(blocks, ops={p: ops for p, ops in blocks.ops.items() if p in chosen},
                   owner={b: n for b, n in blocks.owner.items() if n in chosen})
    policies = {p.removeprefix(prefix): with_cache(eager_plan.policies[p], frozenset())
                for p in paths}
    names = ", ".join(p.removeprefix(prefix) for p in paths)
    memory = simulated_memory(problem, some, (), received_gradient=received_gradient)
    return Candidate(f"checkpoint {names} whole", memory, policies,
                     cost=eager_schedule(problem, some, ()).cost)


def checkpoint_all(eager_plan, prefix: str, *, received_gradient: bool = False) -> Candidate:
    """Every block checkpointed whole, nothing cached (torch's plain checkpoint of each
    block), from any eager plan of the stage (its blocks and policies)."""
    from remat.fx_passes.eager.block_policy import with_cache

    problem, blocks = eager_plan.eager_problem, eager_plan.structure
    schedule = eager_schedule(problem, blocks, ())
    policies = {path.removeprefix(prefix): with_cache(p, frozenset())
                for path, p in eager_plan.policies.items()}
    memory = simulated_memory(problem, blocks, (), received_gradient=received_gradient)
    return Candidate("checkpoint every block", memory, policies, cost=schedule.cost)


__all__ += ["checkpoint_all", "no_checkpoint", "Pass"]
