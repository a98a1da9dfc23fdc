"""An applied block under torch.compile: `torch.compile(model)` of a model an eager plan
wrapped, and per-block compile (`torch.compile(block)` for each block, as torchtitan does).

Dynamo turns `torch.utils.checkpoint` into its activation-checkpoint operator only when
`context_fn` is a module-level function, or a `functools.partial` of one whose arguments are
constants; the closure eager mode passes is refused ("checkpoint not implemented for
NestedUserFunctionVariable context_fn"). So each block's plan is registered under a string key
when the plan is applied, and a traced block passes `partial(compiled_contexts, key)`.
AOTAutograd calls it while it traces the step, and the policy answers op by op; the
partitioner puts what the plan recomputes into the backward graph (PREFER_RECOMPUTE, which it
must honour), where Inductor may fuse it, and saves what the plan caches. A plan made for
torch.compile (`BlockPolicy.prefer_save`) caches with PREFER_SAVE: Inductor's min-cut
partitioner may still recompute such an op from what it saves anyway, if it is on its
allowlist (pointwise ops and views, never a matmul), fused into its backward readers, as plain
torch.compile does. MUST_SAVE forbids that: on benchmarks/inductor.py's Qwen2 (CPU, Inductor),
an eager plan at 60 % of eager's peak read 44.28 MiB with MUST_SAVE and 42.53 MiB with
PREFER_SAVE, for the same recompute FLOPs. Other plans keep MUST_SAVE, which every partitioner
honours (AOTAutograd's default partition fails on a PREFER_SAVE op a recomputation reads).

The ops a traced block dispatches are mostly those eager mode dispatches, not all: attention
with dropout on the CPU runs another kernel path under tracing (``native_dropout`` where eager
allocates with ``empty_like`` and draws with ``bernoulli_``). So the traced policy follows the
plan's op list in order and matches each op to the next planned op of the same name within a
few positions (`LOOKAHEAD`); an op with no such match is recomputed when it is cheap to run
again (no plan position to read it from). Ops that draw random numbers are always cached: on
the CPU a traced recomputation draws new numbers (no RNG functionalization there), and the
gradients would differ from the forward's masks; the eager problem of a plan made for
torch.compile caches them too (`remat.fx_passes.eager.eager_bytes.draws_cached`). Attention
with ``dropout_p=0`` is tagged random but draws nothing: it follows the plan (AOTAutograd
saves a generator state beside each such recomputation, a few bytes). An in-place draw is
never cached: the policy sees one only where dynamo could not trace the block as one graph
(DBRX's expert dispatch, a size read from data) and runs its checkpoint eagerly, whose
replayed generator draws it again; cached, the tensor it writes into (``empty_like(x).
uniform_()``, DBRX's router jitter) was refused by checkpoint as mutated.

What eager mode checks around each block call (the op count, offloads through saved-tensor
hooks) has no traced counterpart: a plan that offloads is refused under torch.compile."""
from __future__ import annotations

from functools import partial
from typing import Any

import torch

from remat.errors import RematError
from remat.fx_passes.eager.call_guard import current
from remat.fx_passes.eager.block_policy import counterpart
from remat.fx_passes.tracing.rng import call_draws
from remat.fx_passes.tracing.plain import records_graph, refuse_backward, wrong_mode_message

__all__ = ["LOOKAHEAD", "aligned_contexts", "compiled_contexts", "register",
           "traced_checkpoint"]

# key -> a block's planned policy (a BlockPolicy, or one per bucket with its call checks).
# Holding the policies keeps their ids unique for as long as a key may be looked up.
_POLICIES: dict[str, Any] = {}
_KEY = "_remat_key"  # the attribute a registered policy carries its key in


def register(planned: Any) -> str:
    """The key a traced block finds `planned` by (registered once per object). The key is
    kept on the policy object itself: dynamo reads a string attribute of it as a constant,
    where a call taking the object (a frozen dataclass holding the call's checks) is one it
    cannot always trace (torch 2.11: "can't reconstruct arbitrary frozen dataclass
    instances")."""
    key = getattr(planned, _KEY, None)
    if key is None:
        key = f"{current(planned).path}@{len(_POLICIES)}"
        _POLICIES[key] = planned
        object.__setattr__(planned, _KEY, key)  # the policies are frozen dataclasses
    return key


def compiled_contexts(key: str):
    """The checkpoint contexts of the block registered under `key`, as AOTAutograd asks for
    them while it traces the block."""
    planned = _POLICIES[key]
    by_bucket = getattr(getattr(planned, "guarded", None), "by_bucket", ())
    if len(by_bucket) > 1:
        raise RematError(
            f"block {current(planned).path!r}: a plan for a range of shapes has a policy per "
            "bucket, which torch.compile cannot choose between at each call; plan one shape "
            "for a compiled model, or run the plan without torch.compile")
    policy = current(planned)
    if policy.offload:
        raise RematError(
            f"block {policy.path!r}: the plan offloads this block's inputs through "
            "saved-tensor hooks, which torch.compile does not run; plan with offload=False "
            "for a compiled model")
    return aligned_contexts(policy)


# How far ahead of the next planned op a traced op is looked for among the plan's ops.
LOOKAHEAD = 8


def aligned_contexts(policy):
    """Checkpoint contexts that follow `policy`'s op list in order, matching each dispatched
    op to the next planned op of its name within `LOOKAHEAD` positions (module docstring)."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    # One cursor per pass: the forward asks, and (torch 2.11) the recomputation asks again
    # for the same ops in the same order.
    cursors = {False: 0, True: 0}
    save = CheckpointPolicy.PREFER_SAVE if policy.prefer_save else CheckpointPolicy.MUST_SAVE

    def decide(ctx, op, *args, **kwargs):
        if call_draws(op, args, kwargs) and not op._schema.is_mutable:
            return CheckpointPolicy.MUST_SAVE
        name = counterpart(str(op))  # an in-place op may be traced functionalized
        start = cursors[ctx.is_recompute]
        for k in range(start, min(start + LOOKAHEAD, len(policy.ops))):
            if counterpart(policy.ops[k]) == name:
                cursors[ctx.is_recompute] = k + 1
                return save if k in policy.cache else CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(decide)


def traced_checkpoint(module: torch.nn.Module, forward, planned: Any, *args, **kwargs):
    """The block's call as dynamo traces it: checkpoint with the plan's policy."""
    from torch.utils.checkpoint import checkpoint

    policy = current(planned)
    if not records_graph(module.parameters(), args, kwargs):
        return forward(*args, **kwargs)
    if policy.training is not None and module.training != policy.training:
        return refuse_backward(forward(*args, **kwargs), wrong_mode_message(
            policy.training, module.training, f"block {policy.path!r}: "))
    return checkpoint(forward, *args, use_reentrant=False,
                      context_fn=partial(compiled_contexts, getattr(planned, _KEY)), **kwargs)
