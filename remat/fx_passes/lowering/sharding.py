"""Sharded data parallelism (ZeRO-2/3, FSDP2) as ops and tensors of the Problem, so that the
simulator and the solver see the memory the collectives hold.

API
---
``shard(problem, captured, *, data_parallel, zero_stage, prefetch=1, backward_prefetch=None,
grad_bytes=None) -> Sharded``
    `problem` is `lower(captured)`. Returns a new Problem with collective ops inserted (all
    `Reason.COLLECTIVE`, never recomputed, never candidates) and, for each of its ops, the index
    of the graph op it is (None for a collective). `project(sharded, schedule)` maps a schedule
    of the sharded problem back onto the graph problem, which is what the rewrite runs.

What is modelled (torch.distributed.fsdp.fully_shard, 2.13, read in _fsdp_param_group.py):
- Units: each repeated block ("layers.3", `remat.solvers.baselines.standard.block_of` of a
  parameter's name) is one `fully_shard` unit; every other parameter belongs to the root unit.
- ``zero_stage >= 2``: a unit's post-backward runs after the last backward op of the unit. It
  copies the unit's full gradients into a reduce-scatter buffer (``reduce_scatter.<unit>``, the
  gradients' bytes), reduce-scatters it, and keeps the shard as the `.grad` the optimizer reads
  (``grad_shard.<unit>``, is_output: the state's gradients). The full gradients die there.
  FSDP2 keeps the last buffer until the next unit's post-backward (``rs_wait.<unit>`` frees it;
  `reduce_scatter_max_input_buffers` = 1). The root's post-backward is the backward's end.
- ``zero_stage == 3``: each unit's parameters are all-gathered into one flat buffer
  (``all_gather.<unit>``, the bytes the graph computes with; on gloo the collective also holds
  a flat copy of its output while it runs: its `temp`), then copied out into the unit's
  unsharded parameters (``copy_out.<unit>``, the same bytes again) at the unit's pre-forward,
  which live to its reshard (``reshard.<unit>``, after its last forward op). Forward: block i is
  gathered at block i - prefetch's pre-forward (the root at the first op); a flat buffer is
  freed only at the next unit's copy-out, the last one at the forward's end
  (``free_gather.<unit>``): FSDP2 defers that free in the forward. The root unit is not
  resharded after the forward (FSDP2's root keeps its parameters for the backward): they live
  to the end of the step. Backward (blocks in reverse): the root's pre-backward, at the
  backward's start, gathers the first `backward_prefetch` blocks (default: `prefetch`), each
  later block is gathered at the pre-backward of the block `backward_prefetch` earlier (FSDP2
  with no explicit prefetch: 0 in the forward, 1 in the backward, its implicit backward
  prefetch, `FSDPParamGroup._backward_prefetch`); a block's flat buffer dies at its copy-out
  (``copy_out_bwd.<unit>``, its pre-backward) and its parameters at its post-backward
  (``reshard_bwd.<unit>``), before the reduce-scatter.
  Checked against the allocator's events of FSDP2 (torch 2.13, gloo, synchronous), in
  tests/fx_passes/test_sharded_memory.py and tests/planner/test_distributed.py.
- With ``zero_stage < 2`` the problem is returned unchanged.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from torch import fx

from remat.fx_passes.tracing.capture import Captured
from remat.fx_passes.lowering.lower import parameter_gradients
from remat.solvers import make_schedule
from remat.solvers.baselines.standard import block_of
from remat.solvers.core.problem import Kind, Op, Phase, Problem, Reason
from remat.solvers.core.schedule import Schedule

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
          prefetch: int = 1, backward_prefetch: int | None = None,
          grad_bytes: int | None = None,
          gather_scratch: bool | None = None, reshard_after_forward: bool = True) -> Sharded:
    """`problem` with the collectives of `zero_stage` over `data_parallel` ranks (module doc).
    `grad_bytes` is the bytes per element of the sharded gradient (the optimizer's dtype;
    default: the graph's). `gather_scratch`: each all-gather also holds a flat copy of its
    output while it runs (gloo's; default: when the graph was captured on the CPU).
    `reshard_after_forward=False` (ZeRO-3 only; FSDP2's option of that name, its ZeRO-2-like
    mode): each block keeps its gathered parameters from its forward to its post-backward,
    and the backward gathers nothing."""
    if gather_scratch is None:
        gather_scratch = captured.device.startswith("cpu")
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
    B = Phase.BACKWARD

    if zero_stage >= 3:
        _gathers(before, after, collective, param_bytes, blocks, reverse, forward, backward,
                 prefetch=prefetch, scratch=gather_scratch, keep=not reshard_after_forward,
                 backward_prefetch=prefetch if backward_prefetch is None else backward_prefetch,
                 first_forward=0,
                 last_forward=problem.num_forward - 1,
                 first_backward=min(problem.backward, default=len(ops)))
    previous = None
    tail = max(problem.backward, default=len(ops) - 1)
    posts = sorted((u for u in reverse if u in backward), key=lambda u: backward[u][1])
    for unit in [*posts, *([ROOT] if ROOT in grads else [])]:
        post = []
        if zero_stage >= 3 and unit != ROOT:
            gathered = "copy_out_bwd" if reshard_after_forward else "copy_out"
            post.append(collective(f"reshard_bwd.{unit}", B, [f"{gathered}.{unit}"]))
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
              "prefetch": prefetch, "backward_prefetch": backward_prefetch,
              "param_gradients": [f"grad_shard.{u}" for u in [*reverse, ROOT] if u in grads]}
    sharded = Problem(tuple(new_ops), name=problem.name, source=source,
                      host_bandwidth=problem.host_bandwidth,
                      host_capacity=problem.host_capacity)
    return Sharded(sharded, tuple(graph_index), problem,
                   frozenset(k for k in moved if isinstance(k, int)))


def _gathers(before: dict, after: dict, collective, param_bytes: dict[str, int],
             blocks: list[str], reverse: list[str], forward: dict, backward: dict, *,
             prefetch: int, backward_prefetch: int, scratch: bool, keep: bool,
             first_forward: int, last_forward: int, first_backward: int) -> None:
    """ZeRO-3's all-gathers, copy-outs and reshards, as FSDP2 runs them synchronously
    (gloo; module doc): `before[i]`/`after[i]` get the collectives to insert around graph op
    i, in the order FSDP2's hooks run them."""
    F, B = Phase.FORWARD, Phase.BACKWARD
    temp = (lambda unit: param_bytes[unit]) if scratch else (lambda unit: 0)  # noqa: E731
    # Forward: units in the order their pre-forward hooks run, the root's first (the model's
    # forward starts it). A unit's flat all-gather output is freed only at the next unit's
    # copy-out (FSDP2 defers the free to overlap the copy with the next all-gather), the last
    # one's at the root's post-forward, the forward's end.
    units = ([ROOT] if ROOT in param_bytes else []) + blocks
    pre = {ROOT: first_forward, **{u: forward[u][0] for u in blocks}}
    for i, unit in enumerate(units):
        # Only blocks prefetch blocks in the forward (FSDP2 prefetches nothing by itself there).
        k = blocks.index(unit) if unit != ROOT else None
        gathered_at = first_forward if k is None else pre[blocks[max(0, k - prefetch)]]
        before.setdefault(gathered_at, []).append(collective(
            f"all_gather.{unit}", F, size=param_bytes[unit], temp=temp(unit)))
        freed = [f"all_gather.{unit}"] + ([f"all_gather.{units[i - 1]}"] if i else [])
        before.setdefault(pre[unit], []).append(collective(
            f"copy_out.{unit}", F, freed, size=param_bytes[unit], is_output=unit == ROOT))
        if unit != ROOT and not keep:  # kept: to the post-backward's reshard_bwd
            after.setdefault(forward[unit][1], []).append(
                collective(f"reshard.{unit}", F, [f"copy_out.{unit}"]))
    if units:
        after.setdefault(last_forward, []).append(
            collective(f"free_gather.{units[-1]}", F, [f"all_gather.{units[-1]}"]))
    # Backward: the root's pre-backward runs first and prefetches the first blocks; each
    # block's flat output is freed at its copy-out. The root keeps its parameters (is_output).
    start = first_backward if ROOT in param_bytes else None
    for j, unit in enumerate([] if keep else reverse):
        if j >= backward_prefetch or start is None:
            at = backward[reverse[max(0, j - backward_prefetch)]][0]
        else:
            at = start
        before.setdefault(at, []).append(collective(
            f"all_gather_bwd.{unit}", B, size=param_bytes[unit], temp=temp(unit)))
        before.setdefault(backward[unit][0], []).append(collective(
            f"copy_out_bwd.{unit}", B, [f"all_gather_bwd.{unit}"], size=param_bytes[unit]))


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
