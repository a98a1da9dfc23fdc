"""What eager PyTorch really does in each block: the ops it dispatches and how long their
outputs live, recorded by running the model's forward once, and matched to the joint graph.

Joint graphs reorder and share some ops (CSE of a causal mask between blocks), so the policy
follows the recorded sequence (`aligned`). And Python variables keep tensors alive beyond their
last use, until the block's forward returns (``q, k = rotate(q), rotate(k)`` holds both
through attention): the recorded lifetimes tell the eager model how long the forward really
holds what the policy does not cache.
"""
from __future__ import annotations

import contextlib
import difflib
import logging
import weakref
from dataclasses import replace
from typing import Any, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from remat.fx_passes.eager.block_policy import BlockPolicy, canonical

log = logging.getLogger(__name__)

__all__ = ["aligned", "probe"]


def probe(model: torch.nn.Module, inputs: Sequence[Any], paths: Sequence[str],
          kwargs: dict[str, Any] | None = None) -> dict[str, tuple[list[str], list[int]]]:
    """Per block, the ops eager PyTorch dispatches and, for each, how many of the block's ops
    had run when its output was freed (the block's op count when it outlived the block's
    forward). The generator and the buffers are put back afterwards: nothing changes."""
    from torch.utils.checkpoint import checkpoint

    seen: dict[str, list[str]] = {p: [] for p in paths}
    freed: dict[str, list[int]] = {p: [] for p in paths}
    alive: dict[str, list[int]] = {p: [] for p in paths}  # outputs of each op not yet freed
    saved = {n: b.detach().clone() for n, b in model.named_buffers()}
    originals = {}

    def recorder(path, forward):
        def contexts():
            from torch.utils.checkpoint import (CheckpointPolicy,
                                                create_selective_checkpoint_contexts)

            def record(ctx, op, *args, **kwargs):
                seen[path].append(canonical(str(op)))
                freed[path].append(-1)
                alive[path].append(0)
                return CheckpointPolicy.PREFER_RECOMPUTE

            def watch(k, output):
                for t in tree_flatten(output)[0]:
                    if isinstance(t, torch.Tensor):
                        alive[path][k] += 1
                        weakref.finalize(t.untyped_storage(), _note, freed[path], alive[path],
                                         seen[path], k)

            caching, recompute = create_selective_checkpoint_contexts(record)

            @contextlib.contextmanager
            def forward_context():  # ours above the caching mode: ops reach ours first
                with caching, _Outputs(seen[path], watch):
                    yield

            return forward_context(), recompute

        def run(*a, **k):
            out = checkpoint(forward, *a, use_reentrant=False, context_fn=contexts, **k)
            # What is still alive when the block returns lives to its end at least.
            freed[path][:] = [len(seen[path]) if n > 0 else f
                              for f, n in zip(freed[path], alive[path])]
            return out

        return run

    try:
        for path in paths:
            module = model.get_submodule(path)
            originals[path] = module.__dict__.get("forward")
            module.forward = recorder(path, module.forward)
        # The generators the forward's random ops draw from: the CPU's, and each GPU's the
        # model is on (fork_rng(devices=[]) forks the CPU's alone).
        gpus = sorted({p.device.index or 0 for p in model.parameters() if p.is_cuda})
        with torch.random.fork_rng(devices=gpus), torch.enable_grad():
            model(*inputs, **(kwargs or {}))
    finally:
        for path, forward in originals.items():
            module = model.get_submodule(path)
            if forward is None:
                del module.forward
            else:
                module.forward = forward
        with torch.no_grad():
            for name, buffer in model.named_buffers():
                buffer.copy_(saved[name])
    return {p: (seen[p], freed[p]) for p in paths}


class _Outputs(TorchDispatchMode):
    """Hands `watch(k, output)` the output of the k-th op the policy was called for. Entered
    above the selective-checkpoint mode, each op passes here on its way to the policy and its
    output comes back here. torch 2.13 also gives the policy the output (`ctx.op_output`), but
    2.11 calls the policy before the op runs; this works on both. Ops the policy is not
    called for (checkpoint's own detaches) are passed over."""

    def __init__(self, seen: list[str], watch) -> None:
        super().__init__()
        self.seen, self.watch = seen, watch

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before = len(self.seen)
        out = func(*args, **(kwargs or {}))
        if len(self.seen) == before + 1:
            self.watch(before, out)
        return out


def _note(freed: list[int], alive: list[int], seen: list[str], k: int) -> None:
    """An output of op `k` was freed: the op's tensors live until the last of them goes."""
    alive[k] -= 1
    freed[k] = len(seen)


def aligned(policy: BlockPolicy, observed: Sequence[str],
            freed: Sequence[int] = ()) -> BlockPolicy:
    """The block's policy over the ops eager PyTorch really dispatches, each matched to the
    joint-graph ops it stands for where the two sequences agree (difflib's longest matching
    blocks); an eager op without a match is never cached, a joint op without one is not
    cacheable. `freed` (from `probe`) gives each matched joint op its forward lifetime."""
    matcher = difflib.SequenceMatcher(a=policy.ops, b=list(observed), autojunk=False)
    joint: list[tuple[int, ...]] = [()] * len(observed)
    cacheable = [False] * len(observed)
    for block in matcher.get_matching_blocks():
        for k in range(block.size):
            joint[block.b + k] = policy.joint[block.a + k]
            cacheable[block.b + k] = policy.cacheable[block.a + k]
    unmatched = len(observed) - sum(b.size for b in matcher.get_matching_blocks())
    if unmatched:
        log.info("block %r: %d of its %d eager ops have no counterpart in the joint graph; "
                 "they are recomputed, never cached", policy.path, unmatched, len(observed))
    # The latest joint op run by each eager position: where a freed tensor's life ends.
    latest, running = [], -1
    for ops in joint:
        running = max([running, *ops])
        latest.append(running)
    life = tuple((j, latest[freed[k] - 1]) for k, ops in enumerate(joint) if k < len(freed)
                 and freed[k] > 0 and latest[freed[k] - 1] >= 0 for j in ops)
    return replace(policy, ops=tuple(observed), joint=tuple(joint),
                   cacheable=tuple(cacheable), life=life)
