"""Apply per-block policies in eager mode: each block's forward wrapped in place with
non-reentrant `torch.utils.checkpoint` and a selective-checkpoint policy that caches
(MUST_SAVE) exactly the ops the plan keeps and recomputes (PREFER_RECOMPUTE) the rest. Ops are
matched by position within the block: the policy counts the ops it is called for, and an op
other than the expected one (or a different count) raises RematError naming the block.

A block call that records no autograd graph (``torch.no_grad()``, ``torch.inference_mode()``,
``generate()``, nothing requiring grad) runs the block plainly: nothing is kept for a backward,
so there is nothing to plan or check. One in the other mode than the plan's (``model.eval()``
with grad enabled) runs plainly too, and a backward through it is refused
(`remat.fx_passes.tracing.plain`)."""
from __future__ import annotations

import itertools
from functools import partial
from typing import Any

import torch

from remat.errors import RematError
from remat.fx_passes.eager.block_policy import BlockPolicy, canonical
from remat.fx_passes.eager.call_guard import current, guard_calls, mismatch_cause
from remat.fx_passes.eager.offload import EagerOffloads
from remat.fx_passes.tracing.call_checks import autocast_state, uncached_autocast
from remat.fx_passes.tracing.plain import records_graph, refuse_backward, wrong_mode_message

__all__ = ["apply_eager"]


def apply_eager(model: torch.nn.Module, policies: dict[str, BlockPolicy]) -> torch.nn.Module:
    """Wrap each block's forward in place (parameter names unchanged, so `fully_shard`, DDP
    and state dicts see the same model). Returns `model`. Guarded policies (an EagerPlan's
    `block_policies`) also check every training call before it runs, and pick each block's
    policy for the call's shapes (`remat.fx_passes.eager.call_guard`)."""
    for path in policies:
        if getattr(model.get_submodule(path), "_remat_policy", None) is not None:
            raise RematError(f"block {path!r} is already wrapped by a remat plan; apply a plan "
                             "once, to a fresh model")
    # Offload (issue 26): None unless some block's policy, for some bucket, offloads inputs.
    offloads = EagerOffloads.of(policies)
    policies = guard_calls(model, policies)
    for path, policy in policies.items():
        module = model.get_submodule(path)
        module._remat_policy = policy
        module.forward = partial(_checkpointed, module, module.forward, policy, offloads)
    return model


def _checkpointed(module: torch.nn.Module, forward, planned: Any,
                  offloads: EagerOffloads | None, *args, **kwargs):
    from torch.utils.checkpoint import checkpoint

    policy = current(planned)  # the block's policy for the call's shapes
    if not records_graph(module.parameters(), args, kwargs):
        return forward(*args, **kwargs)
    if policy.training is not None and module.training != policy.training:
        return refuse_backward(forward(*args, **kwargs), wrong_mode_message(
            policy.training, module.training, f"block {policy.path!r}: "))
    autocast = autocast_state()  # read here: inside dispatch, autocast reads as off

    counters: list[Any] = []

    def contexts():
        counter = itertools.count()
        counters.append(counter)
        return _contexts(policy, counter, lambda: mismatch_cause(planned, module, autocast))

    # Offload (issue 26): saved-tensor hooks around checkpoint's call, so that they see the
    # block's inputs it saves (only in a planned training call: the plain paths above save
    # nothing of the plan's).
    run = checkpoint if offloads is None else offloads.wrap(policy, checkpoint)
    with uncached_autocast():  # the same casts at each call and in the recomputation
        out = run(forward, *args, use_reentrant=False, context_fn=contexts, **kwargs)
    if counters:
        seen = next(counters[0])
        if seen != len(policy.ops):
            raise RematError(
                f"block {policy.path!r}: the run called {seen} ops where the plan's capture had "
                f"{len(policy.ops)}; the block's ops differ between capture and run (other "
                "shapes, flags such as use_cache, or code paths): plan with the inputs and "
                f"settings you train with{mismatch_cause(planned, module, autocast)}")
    return out


def _contexts(policy: BlockPolicy, counter, cause=lambda: ""):
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
                f"the inputs and settings you train with{cause()}")
        return CheckpointPolicy.MUST_SAVE if k in policy.cache else \
            CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(decide)
