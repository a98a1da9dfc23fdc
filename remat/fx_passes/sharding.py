"""Sharded data parallelism (ZeRO-2/3, FSDP2) as ops and tensors of the Problem, so that the
simulator and the solver see the memory the collectives hold.

API
---
``shard(problem, captured, *, data_parallel, zero_stage, prefetch=1, grad_bytes=None) -> Sharded``
    `problem` is `lower(captured)`. Returns a new Problem with collective ops inserted (all
    `Reason.COLLECTIVE`, never recomputed, never candidates) and, for each of its ops, the index
    of the graph op it is (None for a collective). `project(sharded, schedule)` maps a schedule
    of the sharded problem back onto the graph problem, which is what the rewrite runs.

What is modelled (torch.distributed.fsdp.fully_shard, 2.13, read in _fsdp_param_group.py):
- Units: each repeated block ("layers.3", `remat.solvers.baselines.block_of` of a parameter's
  name) is one `fully_shard` unit; every other parameter belongs to the root unit.
- ``zero_stage >= 2``: a unit's post-backward runs after the last backward op of the unit. It
  copies the unit's full gradients into a reduce-scatter buffer (``reduce_scatter.<unit>``, the
  gradients' bytes), reduce-scatters it, and keeps the shard as the `.grad` the optimizer reads
  (``grad_shard.<unit>``, is_output: the state's gradients). The full gradients die there.
  FSDP2 keeps the last buffer until the next unit's post-backward (``rs_wait.<unit>`` frees it;
  `reduce_scatter_max_input_buffers` = 1). The root's post-backward is the backward's end.
- ``zero_stage == 3``: a unit's full parameters (``all_gather.<unit>``, the bytes the graph
  computes with) live from its all-gather to its reshard (``reshard.<unit>``). Forward: block
  i is gathered at block i - prefetch's pre-forward, resharded after its last forward op.
  Backward (blocks in reverse): gathered at the pre-backward of the block `prefetch` earlier in
  backward order, resharded at its post-backward, before the reduce-scatter. The root unit is
  not resharded after the forward (FSDP2's root keeps its parameters for the backward): it
  lives to the end of the step.
- With ``zero_stage < 2`` the problem is returned unchanged.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from torch import fx

from remat.fx_passes.capture import Captured
from remat.fx_passes.lower import parameter_gradients
from remat.solvers import make_schedule
from remat.solvers.baselines import block_of
from remat.solvers.problem import Kind, Op, Phase, Problem, Reason
from remat.solvers.schedule import Schedule

__all__ = ["Sharded", "shard", "project"]

ROOT = "root"


@dataclass(frozen=True)
class Sharded:
    problem: Problem
    graph_index: tuple[int | None, ...]
    """For each op of `problem`, the index of the same op in the graph problem, or None."""
    graph: Problem
    """The graph problem (what the rewrite runs)."""
    moved: frozenset[int] = frozenset()
    """Graph ops placed elsewhere in `problem` than in the graph problem (gradient views)."""


def _nbytes(node: fx.Node) -> tuple[int, int]:
    val = node.meta.get("val")
    return int(val.numel() * val.element_size()), int(val.numel())


def shard(problem: Problem, captured: Captured, *, data_parallel: int, zero_stage: int,
          prefetch: int = 1, grad_bytes: int | None = None) -> Sharded:
    """`problem` with the collectives of `zero_stage` over `data_parallel` ranks (module doc).
    `grad_bytes` is the bytes per element of the sharded gradient (the optimizer's dtype;
    default: the graph's)."""
    identity = Sharded(problem, tuple(range(len(problem))), problem)
    if zero_stage < 2:
        return identity
    ops = problem.ops
    index = {op.name: i for i, op in enumerate(ops)}
    placeholders = {n.name: n for n in captured.placeholders}
    grad_of = parameter_gradients(captured)

    unit_of = {p: block_of(name) or ROOT for p, name in captured.params.items()}
    param_bytes: dict[str, int] = {}
    grad_numel: dict[str, int] = {}
    grad_elem: dict[str, int] = {}
    grads: dict[str, list[int]] = {}
    for p, unit in unit_of.items():
        nbytes, numel = _nbytes(placeholders[p])
        param_bytes[unit] = param_bytes.get(unit, 0) + nbytes
        if p in grad_of and grad_of[p] in index:
            grads.setdefault(unit, []).append(index[grad_of[p]])
            grad_numel[unit] = grad_numel.get(unit, 0) + numel
            grad_elem[unit] = grad_bytes or nbytes // max(numel, 1)

    moved = _gradient_views(problem, [g for gs in grads.values() for g in gs])
    forward, backward = {}, {}  # unit -> [first, last] op index
    for i, op in enumerate(ops):
        unit = block_of(op.module)
        if i in moved:
            continue
        if unit is None or unit not in param_bytes:
            continue
        span = (forward if op.phase is Phase.FORWARD else backward).setdefault(unit, [i, i])
        span[0], span[1] = min(span[0], i), max(span[1], i)
    for unit, gs in grads.items():
        if unit in backward:
            backward[unit][1] = max([backward[unit][1], *(problem.root[g] for g in gs)])
    blocks = sorted(forward, key=lambda u: forward[u][0])
    reverse = sorted((u for u in blocks if u in backward), key=lambda u: backward[u][0])

    before: dict[int, list[Op]] = {}
    after: dict[int, list[Op]] = {}
    # Synthetic ops name their inputs; graph ops are named as themselves.
    collective = lambda name, phase, inputs=(), size=0, **kw: Op(  # noqa: E731
        name=name, phase=phase, inputs=tuple(inputs), size=int(size), kind=Kind.TENSOR,
        not_recomputable=Reason.COLLECTIVE, module="" if ROOT in name else name.split(".", 1)[1],
        target=f"remat.{name.split('.', 1)[0]}", **kw)
    F, B = Phase.FORWARD, Phase.BACKWARD

    if zero_stage >= 3:
        if ROOT in param_bytes and ops:
            before.setdefault(0, []).append(collective(
                f"all_gather.{ROOT}", F, size=param_bytes[ROOT], is_output=True))
        for i, unit in enumerate(blocks):
            at = forward[blocks[max(0, i - prefetch)]][0]
            before.setdefault(at, []).append(
                collective(f"all_gather.{unit}", F, size=param_bytes[unit]))
            after.setdefault(forward[unit][1], []).append(
                collective(f"reshard.{unit}", F, [f"all_gather.{unit}"]))
        for j, unit in enumerate(reverse):
            at = backward[reverse[max(0, j - prefetch)]][0]
            before.setdefault(at, []).append(
                collective(f"all_gather_bwd.{unit}", B, size=param_bytes[unit]))
    previous = None
    tail = max(problem.backward, default=len(ops) - 1)
    posts = sorted((u for u in reverse if u in backward), key=lambda u: backward[u][1])
    for unit in [*posts, *([ROOT] if ROOT in grads else [])]:
        post = []
        if zero_stage >= 3 and unit != ROOT:
            post.append(collective(f"reshard_bwd.{unit}", B, [f"all_gather_bwd.{unit}"]))
        if previous is not None:
            post.append(collective(f"rs_wait.{previous}", B, [f"reduce_scatter.{previous}"]))
        gs = [ops[g].name for g in grads.get(unit, [])]
        full = sum(ops[problem.root[g]].size for g in dict.fromkeys(
            problem.root[index[n]] for n in gs))
        shard_bytes = math.ceil(grad_numel.get(unit, 0) / data_parallel) * grad_elem.get(unit, 0)
        post.append(collective(f"reduce_scatter.{unit}", B, gs, size=full))
        # The full gradients die once the shard is made (FSDP2 drops them as post_backward
        # returns); the shard is the .grad the optimizer reads: state, to the end of the step.
        post.append(collective(f"grad_shard.{unit}", B, [f"reduce_scatter.{unit}", *gs],
                               size=shard_bytes, is_output=True))
        after.setdefault(tail if unit == ROOT else backward[unit][1], []).extend(post)
        previous = unit

    graph_grads = {g for gs in grads.values() for g in gs}
    new_ops: list[Op] = []
    graph_index: list[int | None] = []
    position: dict[str, int] = {}

    def emit(op: Op, source: int | None, inputs: list[str]) -> None:
        position[op.name] = len(new_ops)
        new_ops.append(Op(**{**op.__dict__, "inputs": tuple(position[n] for n in inputs)}))
        graph_index.append(source)

    def emit_graph(i: int) -> None:
        op = ops[i]
        keep = op if i not in graph_grads else Op(**{**op.__dict__, "is_output": False})
        emit(keep, i, [ops[j].name for j in op.inputs])

    for i, op in enumerate(ops):
        for extra in before.get(i, []):
            emit(extra, None, list(extra.inputs))
        if i not in moved:
            emit_graph(i)
            for v in moved.get(("after", i), ()):
                emit_graph(v)
        for extra in after.get(i, []):
            emit(extra, None, list(extra.inputs))
    source = {**problem.source, "zero_stage": zero_stage, "data_parallel": data_parallel,
              "prefetch": prefetch,
              "param_gradients": [f"grad_shard.{u}" for u in [*reverse, ROOT] if u in grads]}
    sharded = Problem(tuple(new_ops), name=problem.name, source=source,
                      host_bandwidth=problem.host_bandwidth)
    return Sharded(sharded, tuple(graph_index), problem,
                   frozenset(k for k in moved if isinstance(k, int)))


def _gradient_views(problem: Problem, grads: list[int]) -> dict:
    """Gradients that are views (a weight's gradient is often the transpose of a matmul):
    lowering sinks a view to its first reader, and an output has none, so these sit at the
    end of the backward, where they would keep their base alive to the step's end once they
    are no longer outputs. Each moves, with the views it is taken through, to just after its
    base, where autograd makes it. Returns {view: base} and {("after", base): [views]}."""
    moved: dict = {}
    for g in sorted(grads):
        chain = []
        v = g
        while problem.ops[v].kind is Kind.VIEW:
            chain.append(v)
            v = problem.ops[v].inputs[0]
        others = [j for c in chain for j in problem.ops[c].inputs[1:]]
        if not chain or any(j > v for j in others):
            continue  # read something made after its base: leave it where it is
        for c in reversed(chain):
            if c not in moved:
                moved[c] = v
                moved.setdefault(("after", v), []).append(c)
    return moved


def project(sharded: Sharded, schedule: Schedule) -> Schedule:
    """The schedule of the graph problem that makes the same decisions as `schedule` (a
    schedule of `sharded.problem`): what the rewrite runs."""
    if sharded.problem is sharded.graph:
        return schedule
    to_graph = sharded.graph_index

    def place(b: int) -> int:
        # Before a collective or a moved view: before the next graph op in its place.
        while to_graph[b] is None or to_graph[b] in sharded.moved:
            b += 1
        return to_graph[b]

    recomputed = {to_graph[v] for v in schedule.recomputed}
    at = {to_graph[v]: place(b) for v, b in schedule.recompute_at.items()}
    again = {to_graph[v]: tuple(sorted({place(p) for p in ps}))
             for v, ps in schedule.again.items()}
    offload_at = {to_graph[v]: place(b) for v, b in schedule.offload_at.items()}
    return make_schedule(sharded.graph, recomputed, recompute_at=at, again=again,
                         offload_at=offload_at, strategy=schedule.strategy,
                         status=schedule.status, budget=None)
