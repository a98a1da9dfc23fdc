"""Offload in the eager mode: which tensors a checkpointed block's frame may keep in host memory,
and where they go and come back. Torch-free; `remat.solvers.timeline.eager` times and holds
them, `remat.solvers.eager.heuristic.choose_offloads` chooses among them,
`remat.fx_passes.eager.offload` runs them.

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

from typing import Iterable

from remat.solvers.core.problem import Kind, Problem
from remat.solvers.timeline.eager_blocks import BlockRun, EagerBlocks

__all__ = ["offload_points", "offloadable"]


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
