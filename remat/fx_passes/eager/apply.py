"""Apply per-block policies in eager mode: each block's forward wrapped in place with
non-reentrant `torch.utils.checkpoint` and a selective-checkpoint policy that caches
(MUST_SAVE) exactly the ops the plan keeps and recomputes (PREFER_RECOMPUTE) the rest. Ops are
matched by position within the block: the policy counts the ops it is called for, and an op
other than the expected one (or a different count) raises RematError naming the block."""
from __future__ import annotations

import itertools
from functools import partial
from typing import Any

import torch

from remat.errors import RematError
from remat.fx_passes.eager.block_policy import BlockPolicy, canonical

__all__ = ["apply_eager"]


def apply_eager(model: torch.nn.Module, policies: dict[str, BlockPolicy]) -> torch.nn.Module:
    """Wrap each block's forward in place (parameter names unchanged, so `fully_shard`, DDP
    and state dicts see the same model). Returns `model`. A module called several times in
    a step (ALBERT's shared layer) has a policy per call, in order: its calls take them in
    turn."""
    by_module: dict[str, list[BlockPolicy]] = {}
    for policy in policies.values():
        by_module.setdefault(policy.path, []).append(policy)
    for path, runs in by_module.items():
        module = model.get_submodule(path)
        if getattr(module, "_remat_policy", None) is not None:
            raise RematError(f"block {path!r} is already wrapped by a remat plan; apply a plan "
                             "once, to a fresh model")
        module._remat_policy = runs[0] if len(runs) == 1 else tuple(runs)
        module.forward = partial(_checkpointed, module.forward, runs[0]) if len(runs) == 1 \
            else partial(_in_turn, module.forward, runs, itertools.count())
    return model


def _in_turn(forward, runs: list[BlockPolicy], calls, *args, **kwargs):
    return _checkpointed(forward, runs[next(calls) % len(runs)], *args, **kwargs)


def _checkpointed(forward, policy: BlockPolicy, *args, **kwargs):
    from torch.utils.checkpoint import checkpoint

    counters: list[Any] = []

    def contexts():
        counter = itertools.count()
        counters.append(counter)
        return _contexts(policy, counter)

    out = checkpoint(forward, *args, use_reentrant=False, context_fn=contexts, **kwargs)
    if counters:
        seen = next(counters[0])
        if seen != len(policy.ops):
            raise RematError(
                f"block {policy.path!r}: the run called {seen} ops where the plan's capture had "
                f"{len(policy.ops)}; the block's ops differ between capture and run (other "
                "shapes, flags such as use_cache, or code paths): plan with the inputs and "
                "settings you train with")
    return out


def _contexts(policy: BlockPolicy, counter):
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    # torch 2.13 asks once per op, in the forward, and replays the answers in the
    # recomputation; 2.11 asks again for each op it recomputes (`ctx.is_recompute`), and
    # must get the forward's answer for the same position.
    recomputed = itertools.count()

    def decide(ctx, op, *args, **kwargs):
        k = next(recomputed if ctx.is_recompute else counter)
        name = canonical(str(op))
        if k >= len(policy.ops) or policy.ops[k] != name:
            expected = policy.ops[k] if k < len(policy.ops) else "nothing more"
            raise RematError(
                f"block {policy.path!r}: op {k} of the run is {name} where the plan's capture "
                f"had {expected}; the block's ops differ between capture and run: plan with "
                "the inputs and settings you train with")
        return CheckpointPolicy.MUST_SAVE if k in policy.cache else \
            CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(decide)
