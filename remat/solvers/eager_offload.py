"""Offload in the eager mode: which tensors a checkpointed block's frame may keep in
host memory, where they go and come back, and which to choose. Torch-free; `remat.solvers.eager`
times and holds them, `remat.fx_passes.eager.offload` runs them.

What the eager mode can move is what `torch.utils.checkpoint` saves through the saved-tensor
hooks around a block: the block's inputs (everything inside the block is checkpoint's own, and
what its selective policy caches stays in its cache). So an offloadable value is the input of
exactly one checkpointed block (B), a tensor that owns its bytes, that no policy caches, and
that nothing but B reads in the backward (its own block's recomputation, when it recomputes it,
reads its own new copy): then once B's forward has run, checkpoint's frame is all that keeps it.
- Its copy to host is issued when B's checkpoint returns (after B's last forward op); the device
  copy lives until the copy ends (a caching allocator keeps a block a side stream still reads).
- Its load is issued when the block whose backward runs just before B's unpacks its own inputs
  (that block's trigger): one block of prefetch; B's recomputation, at B's trigger, waits for it.
  The first block to run its backward has no earlier trigger: its inputs load at its own.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterable

from remat.solvers.deadline import Deadline
from remat.solvers.problem import Kind, Problem

if TYPE_CHECKING:
    from remat.solvers.eager import BlockRun, EagerBlocks
    from remat.solvers.schedule import Schedule

__all__ = ["choose_offloads", "offload_points", "offloadable"]


def offloadable(problem: Problem, blocks: EagerBlocks, runs: list[BlockRun]) -> dict[int, str]:
    """The values the eager mode may offload (module docstring), each with the block (B)
    whose input it is."""
    nf = problem.num_forward
    holders: dict[int, list[BlockRun]] = {}
    for run in runs:
        if run.end is not None:
            for s in run.inputs:
                holders.setdefault(s, []).append(run)
    cached = {v for run in runs for v in run.cached}
    recomputed = {v: run.name for run in runs for v in run.recomputed}
    block_of, owner = blocks.block_of(), blocks.owner
    found: dict[int, str] = {}
    for s, held in holders.items():
        op = problem.ops[s]
        if len(held) != 1 or op.kind is not Kind.TENSOR or not op.size or s >= nf \
                or problem.root[s] != s or s in problem.pinned or s in cached:
            continue
        name, own = held[0].name, block_of.get(s)
        own_copy = s in recomputed  # its own block's backward reads its recomputed copy
        reads_ok = all(owner.get(r) == name or (own_copy and owner.get(r) == own)
                       for r in problem.storage_readers[s] if r >= nf)
        reruns_ok = all(block_of.get(r) == name or (own_copy and block_of.get(r) == own)
                        for r in problem.storage_readers[s] if r < nf and r in recomputed)
        if reads_ok and reruns_ok:
            found[s] = name
    return found


def offload_points(blocks: EagerBlocks, runs: list[BlockRun], offload: Iterable[int],
                   eligible: dict[int, str]) -> tuple[dict[int, int], dict[int, int]]:
    """(the backward op before which each offloaded value is loaded, the forward op after
    which its copy to host is issued) for `offload`, a subset of `eligible`."""
    run_of = {run.name: run for run in runs}
    triggers = sorted(run.trigger for run in runs if run.trigger is not None)
    loads, issues = {}, {}
    for s in offload:
        run = run_of[eligible[s]]
        if run.trigger is None:
            raise ValueError(f"offloading op {s}: its block {run.name!r} never recomputes")
        earlier = [t for t in triggers if t < run.trigger]
        loads[s] = earlier[-1] if earlier else run.trigger
        issues[s] = max(blocks.ops[run.name])
    return loads, issues


def choose_offloads(problem: Problem, eligible: dict[int, str],
                    schedule_of: Callable[[frozenset[int]], Schedule],
                    deadline: Deadline | None = None) -> frozenset[int]:
    """The offloads to plan with: largest first, each taken when the host holds it
    (`Problem.host_capacity`) and the step waits no longer for the transfers with it
    (`schedule_of(offloads)`'s `exposed_time`, under some fixed cache): what moves to host
    for free, making room to cache (and recompute) less. Past `deadline`, those chosen so far
    (one schedule is evaluated per candidate)."""
    capacity, ops = problem.host_capacity, problem.ops
    chosen: frozenset[int] = frozenset()
    held, exposed = 0, schedule_of(chosen).exposed_time
    for s in sorted(eligible, key=lambda s: (-ops[s].size, s)):
        if deadline is not None and not deadline.check("eager offloads"):
            break
        if capacity is not None and held + ops[s].size > capacity:
            continue
        trial = schedule_of(chosen | {s})
        if trial.exposed_time <= exposed + 1e-12:
            chosen, held, exposed = chosen | {s}, held + ops[s].size, trial.exposed_time
    return chosen
