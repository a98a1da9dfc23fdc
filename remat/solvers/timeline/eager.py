"""The eager execution mode: recomputation by `torch.utils.checkpoint` with a selective policy
per block, and a planner for it. Torch-free.

In this mode (docs/execution-model.md, "Eager plans") each checkpointed block runs its forward once,
keeping only what its policy caches (MUST_SAVE) and what checkpoint itself keeps: the block's
inputs and the generator's state. When autograd first unpacks a tensor saved inside the block
(the block's *trigger*, a backward op), checkpoint re-runs the block's forward from its start,
every op that is not cached, and stops early once the last tensor the block's autograd nodes
saved has been packed again (its *stop*, the last forward op whose autograd node saves
something). So, unlike the compiled mode, a recomputation cannot be placed: it runs at the
trigger, all of the block's at once, and it runs every uncached op up to the stop, whether the
backward needs its output or not (an op with several outputs is one call: cached when all its
tensors are, as an attention kernel's output and logsumexp).

`eager_schedule(problem, blocks, cached)` derives what this mode recomputes and when, and
`eager_timeline` its memory, with `remat.solvers.timeline.simulate`'s conventions (steps in order, a
storage live from its step to its last reader's, temp during its step, a tensor taken out of a
tuple op live from the step after it). Which copy a backward op reads: the recomputed one when
the op belongs to the value's own block (its autograd node was packed inside the checkpoint),
the original otherwise. What lives longer than its readers: a block's inputs, which checkpoint
holds until the block's backward ends, and so its ops that may not be recomputed, but for the
routing decisions (top-k) that every policy caches (`eager_blocks.always_cached`), held as any
cached value; cached values that the recomputation stops before
(held by the checkpoint's frame until then too); cached values the recomputation takes out,
held by the block's Python variables as long as in the forward (`forward_life`); a backward
value, until the autograd node that reads it last has finished (`node_end`); generator
snapshots, and on the CPU the copy of the generator's state that the recomputation's
fork_rng keeps while it runs, the Python numbers autograd nodes keep as tensors
(`EagerBlocks.kept_numbers`), and the tensors that no op reads (`unused_tensors`).

The planners: the heuristic `remat.solvers.eager.heuristic.plan_eager` (status HEURISTIC; from
seed cache sets it repairs, caching less, until the eager peak fits and improves, caching
more, while it still fits; with offloads of block inputs, `remat.solvers.timeline.eager_offload`),
and the exact `remat.solvers.eager.search.optimal_eager` (CP-SAT over this timeline, every
rule above followed: `EagerModel`; it plans no offload), which the heuristic hints.
"""
from __future__ import annotations

import logging
from types import MappingProxyType
from typing import Iterable, Mapping

from remat.solvers.core.problem import Kind, Problem, recompute_blocker, tuple_of
from remat.solvers.core.schedule import Schedule, Status
from remat.solvers.timeline.eager_blocks import BlockRun, EagerBlocks, block_runs
from remat.solvers.timeline.eager_offload import offload_points, offloadable
from remat.solvers.timeline.overlap import Transfers, transfers
from remat.solvers.timeline.simulate import StepKind, Timeline, step_order, steps_of, timeline_of

log = logging.getLogger(__name__)


def eager_schedule(problem: Problem, blocks: EagerBlocks, cached: Iterable[int], *,
                   offload: Iterable[int] = (), strict: bool = True, strategy: str = "eager",
                   status: Status = Status.HEURISTIC, budget: int | None = None) -> Schedule:
    """The `Schedule` that the eager mode runs for a policy caching `cached`: `saved` is what
    the forward keeps for the backward (cached values, and everything outside the blocks that
    the backward reads), `recomputed` what the checkpoints run again and `recompute_at` their
    triggers. Its `peak` is `eager_timeline`'s, not `simulate`'s. `offload`: block inputs
    kept in host memory (`remat.solvers.timeline.eager_offload`; `offload_at` their loads), their
    transfers timed by `remat.solvers.timeline.overlap` (the cost includes what the step waits); one
    that this cache makes impossible raises ValueError, or with `strict=False` (a planner's
    trial) stays on the device, as `offload_at` then says."""
    runs = block_runs(problem, blocks, cached)
    offload = frozenset(offload)
    loads, issues = {}, {}
    if offload:
        eligible = offloadable(problem, blocks, runs)
        refused = sorted(offload - eligible.keys())
        if not strict:
            offload, refused = offload & eligible.keys(), []
        if refused:
            raise ValueError(f"the eager mode cannot offload {problem.ops[refused[0]].name!r}: "
                             "only the input of one checkpointed block that nothing else holds")
        loads, issues = offload_points(blocks, runs, offload, eligible)
    timeline, moved = eager_timeline(problem, blocks, runs, loads=loads, issues=issues)
    in_blocks = set(blocks.block_of())
    recomputed = {v: run.trigger for run in runs for v in run.recomputed}
    needed_outside = {problem.root[s] for b in problem.backward for s in problem.storage_inputs[b]
                      if s < problem.num_forward and problem.root[s] not in in_blocks}
    saved = frozenset(needed_outside | {v for run in runs for v in run.cached})
    exposed = moved.exposed if moved is not None else 0.0
    return Schedule(
        saved=saved, recomputed=frozenset(recomputed), recompute_at=MappingProxyType(recomputed),
        strategy=strategy, status=status, budget=budget,
        cost=sum(problem.ops[v].cost for v in recomputed) + exposed,
        recompute_flops=sum(problem.ops[v].flops for v in recomputed), peak=timeline.peak,
        offload_at=MappingProxyType(loads), exposed_time=exposed,
        transfer_time=moved.link_time if moved is not None else 0.0,
        info={"execution": "eager", "cached": tuple(sorted(v for r in runs for v in r.cached)),
              "offload": tuple(sorted(offload)),
              "blocks": {r.name: {"trigger": r.trigger, "stop": r.stop,
                                  "recomputed": len(r.recomputed), "cached": len(r.cached)}
                         for r in runs}})


def eager_transfers(problem: Problem, blocks: EagerBlocks, schedule: Schedule
                    ) -> Transfers | None:
    """The transfer timeline of an eager schedule's offloads (None: it offloads nothing)."""
    offload = schedule.info.get("offload", ())
    if not offload:
        return None
    runs = block_runs(problem, blocks, schedule.info["cached"])
    loads, issues = offload_points(blocks, runs, offload, offloadable(problem, blocks, runs))
    return eager_timeline(problem, blocks, runs, loads=loads, issues=issues)[1]


def eager_timeline(problem: Problem, blocks: EagerBlocks, runs: list[BlockRun], *,
                   loads: Mapping[int, int] | None = None,
                   issues: Mapping[int, int] | None = None) -> tuple[Timeline, Transfers | None]:
    """The memory of the step in eager mode, step by step (see the module's docstring), and
    the timeline of its offloads' transfers (`loads`, `issues`: see `eager_holds`)."""
    order, held, moved = eager_holds(problem, blocks, runs, loads=loads, issues=issues)
    return timeline_of(problem, order, held), moved


def eager_holds(problem: Problem, blocks: EagerBlocks, runs: list[BlockRun], *,
                loads: Mapping[int, int] | None = None, issues: Mapping[int, int] | None = None
                ) -> tuple[list[tuple[int, StepKind]], list[tuple[int, int, int, int]],
                           Transfers | None]:
    """`eager_timeline`'s step order, its holds, (-1, bytes, first step, last step) each (op
    temps aside), and its offloads' transfers: what lives across a gap between two steps (a
    pipeline stage's, between its forward and its backward) is read off the holds, not off a
    step's live bytes. `loads`: value -> the backward op its load is placed before; `issues`:
    value -> the forward op after which its copy to host is issued
    (`remat.solvers.timeline.eager_offload.offload_points`): an offloaded value's device copy lives
    from its op to its last forward read or the end of its copy to host, its loaded copy from its
    load to what would have held it in the backward."""
    ops = problem.ops
    nf = problem.num_forward
    at = {v: run.trigger for run in runs if run.trigger is not None for v in run.recomputed}
    pseudo = Schedule(saved=frozenset(), recomputed=frozenset(at), recompute_at=at,
                      offload_at=dict(loads or {}))
    order = step_order(problem, pseudo)
    step_of, again = steps_of(order, len(ops))
    end = len(order) - 1
    moved = None
    if loads:
        moved = transfers(problem, pseudo, order, join_forward=False,
                          issue_after={v: step_of[b] for v, b in (issues or {}).items()})
    load_step = {i: t for t, (i, kind) in enumerate(order) if kind is StepKind.RELOAD}
    forward_end = step_of[nf - 1] if nf else -1

    block_of = blocks.block_of()
    owner = blocks.owner
    run_of = {run.name: run for run in runs}
    # How long checkpoint itself holds a storage: a block's inputs until the autograd node of
    # its last backward op finishes (the node's saved tensors hold checkpoint's frame: an
    # addmm's bias gradient runs after its last read), cached values the recomputation never
    # reaches, ops that may not be recomputed and are not cached, and snapshots to the same;
    # the cache holds the values it reaches until the recomputation takes them out.
    node_end = blocks.node_end
    finished = {run.name: step_of[node_end.get(run.end, run.end)] for run in runs
                if run.end is not None}
    held_to: dict[int, int] = {}
    for run in runs:
        if run.end is None:
            continue
        kept = list(run.inputs) + [v for v in run.cached if run.stop is None or v > run.stop]
        cached = set(run.cached)  # the routing decisions every policy caches among them
        kept += [v for v in blocks.ops[run.name] if recompute_blocker(problem, v) is not None
                 and ops[v].kind is not Kind.VIEW and v not in cached]
        for s in kept:
            held_to[s] = max(held_to.get(s, 0), finished[run.name])
        if run.trigger is not None:
            taken = step_of[run.trigger] - len(run.recomputed)  # the recomputation's first step
            for v in run.cached:
                if v <= run.stop:
                    # Taken out, it is the recomputation's value: the block's Python variables
                    # hold it as long as they held it in the forward (`forward_life`).
                    lives_to = blocks.forward_life.get(v, -1)
                    frame = [again[u] for u in run.recomputed if u <= lives_to]
                    held_to[v] = max(held_to.get(v, 0), taken, *frame)

    held: list[tuple[int, int, int, int]] = []

    def hold(size: int, start: int, stop: int) -> None:
        held.append((-1, size, start, stop))

    readers = problem.storage_readers
    pinned = problem.pinned

    def read_at(r: int) -> int:  # when a backward op's read of a saved tensor ends
        return step_of[node_end.get(r, r)]

    for i, op in enumerate(ops):
        if problem.root[i] != i or op.size == 0:
            continue
        t = tuple_of(problem, i)
        made = step_of[i] if t is None else step_of[t] + 1
        if i in pinned:
            hold(op.size, made, end)
            continue
        if i >= nf:
            # An autograd node's formula holds its temporaries and its input gradient until
            # it returns (RMSNorm's PowBackward0: x.pow(1), 2 * it and their product at once);
            # a backward written in Python frees its own temporaries as it goes.
            python = i in blocks.python_backward
            hold(op.size, made, max(
                step_of[r] if python and node_end.get(r, r) == node_end.get(i, i)
                else read_at(r) for r in (i, *readers[i])))
            continue
        block = block_of.get(i)
        run = run_of.get(block) if block is not None else None
        recomputed = run is not None and i in run.recomputed
        original, copy = [made, held_to.get(i, made)], []
        lives_to = blocks.forward_life.get(i)
        if lives_to is not None:
            original.append(step_of[lives_to])
            if recomputed:  # the recomputation's variables: to the same op, or its end
                copy.extend(again[v] for v in run.recomputed if v <= lives_to)
        for r in readers[i]:
            if r < nf:
                original.append(step_of[r])
                if r in again:  # read again by a recomputation
                    same_block = block_of.get(r) == block
                    (copy if recomputed and same_block else original).append(again[r])
            elif recomputed and owner.get(r) == block:
                copy.append(read_at(r))
            else:
                original.append(read_at(r))
        if moved is not None and i in moved.by_value:  # in host memory in between
            late = [t for t in original if t > forward_end]
            hold(op.size, made, max([t for t in original if t <= forward_end]
                                    + [moved.by_value[i].released]))
            hold(op.size, load_step[i], max(late, default=load_step[i]))
        else:
            hold(op.size, made, max(original))
        if recomputed:
            start = again[i] if t is None else again[t] + 1
            hold(op.size, start, max(copy, default=start))

    for run in runs:
        if run.end is not None and blocks.state_bytes:
            hold(blocks.state_bytes, step_of[blocks.ops[run.name][0]], finished[run.name])
        if run.trigger is not None and run.recomputed and blocks.state_bytes:
            # The recomputation runs inside fork_rng, which keeps a copy of the current state.
            trigger = step_of[run.trigger]
            hold(blocks.state_bytes, trigger - len(run.recomputed), trigger - 1)
    for size, names in blocks.unread_inputs:
        ends = [finished[n] for n in names if n in finished]
        if ends:
            hold(size, min(step_of[blocks.ops[n][0]] for n in names), max(ends))
    for size, v, b in blocks.kept_numbers:  # the op's temp is the number while it runs
        hold(size, step_of[v] + 1, read_at(b))
    for size, first, last, _ in blocks.unused_tensors:  # from the op it follows
        hold(size, step_of[first], step_of[last])
    # A block's recomputation runs its Python code again (a cached op's too), to its end.
    for size, v, after in [*((n, v, v) for n, v, _ in blocks.kept_numbers),
                           *((n, a, a - 1) for n, a, _, made in blocks.unused_tensors if made)]:
        run = run_of.get(block_of.get(v))
        later = [again[u] for u in run.recomputed if u > after] if run is not None else []
        if later:
            hold(size, min(later), step_of[run.trigger] - 1)
    return order, held, moved

