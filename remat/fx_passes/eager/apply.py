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

import contextlib
import itertools
import weakref
from functools import partial
from typing import Any

import torch

from remat.errors import RematError
from remat.fx_passes.eager.block_policy import BlockPolicy
from remat.fx_passes.eager.call_guard import (autocast_cause, current, guard_calls,
                                              mismatch_cause)
from remat.fx_passes.eager.offload import EagerOffloads
from remat.fx_passes.eager.recompute_state import with_state_kept
from remat.fx_passes.eager.runs import module_path, run_index
from remat.fx_passes.eager.selective import policy_contexts
from remat.fx_passes.eager.traced import register, traced_checkpoint
from remat.fx_passes.tracing.call_checks import autocast_state, uncached_autocast
from remat.fx_passes.tracing.plain import records_graph, refuse_backward, wrong_mode_message

__all__ = ["apply_eager", "remove_eager"]


def apply_eager(model: torch.nn.Module, policies: dict[str, BlockPolicy]) -> torch.nn.Module:
    """Wrap each block's forward in place (parameter names unchanged, so `fully_shard`, DDP
    and state dicts see the same model). Returns `model`. Guarded policies (an EagerPlan's
    `block_policies`) also check every training call before it runs, and pick each block's
    policy for the call's shapes (`remat.fx_passes.eager.call_guard`). A module called
    several times in a step (ALBERT's shared layer) has a policy per run (``path#k``,
    `remat.fx_passes.eager.runs`): its calls that run the plan take them in turn, from the
    first at each call of `model`; a run the policies leave out runs without checkpoint. A call
    of `model` that runs such a module more times than the plan has runs is refused (the step
    is not the one planned); called on its own, outside `model`, the module takes the runs in
    turn and starts over after the last."""
    by_module: dict[str, dict[int | None, str]] = {}
    for name in policies:
        by_module.setdefault(module_path(name), {})[run_index(name)] = name
    for path in by_module:
        if getattr(model.get_submodule(path), "_remat_policy", None) is not None:
            raise RematError(f"block {path!r} is already wrapped by a remat plan; apply a plan "
                             "once, to a fresh model")
    # Offload: None unless some block's policy, for some bucket, offloads inputs.
    offloads = EagerOffloads.of(policies)
    undo = _Applied()
    planned = guard_calls(model, policies, undo.handles)
    for p in planned.values():  # found again by key where torch.compile traces the blocks
        register(p)
    turns: list[_Turn] = []
    for path, names in by_module.items():
        module = model.get_submodule(path)
        undo.blocks.append((module, module.__dict__.get("forward", _NONE)))
        if None in names:
            module._remat_policy = planned[names[None]]
            module.forward = partial(_checkpointed, module, module.forward, planned[names[None]],
                                     offloads)
            continue
        runs = tuple(planned.get(names.get(k)) for k in range(max(names) + 1))
        turns.append(_Turn())
        module._remat_policy = runs
        module.forward = partial(_in_turn, module, module.forward, runs, turns[-1], offloads)
    if turns:
        def first_turn(module, args):  # each step starts at the first run, whatever came before
            for turn in turns:
                turn.next, turn.in_model_call = 0, True

        def call_ended(module, args, output):
            for turn in turns:
                turn.in_model_call = False

        undo.handles += [model.register_forward_pre_hook(first_turn),
                         model.register_forward_hook(call_ended, always_call=True)]
    model._remat_applied = undo
    return model


def remove_eager(model: torch.nn.Module) -> torch.nn.Module:
    """Undo `apply_eager(model, ...)`: each block's forward as it was before, the call
    checks and turn hooks removed, so that another plan can be applied. Returns `model`."""
    undo = model.__dict__.pop("_remat_applied", None)
    if undo is None:
        raise RematError("remove_eager: no remat plan is applied to this model")
    for handle in undo.handles:
        handle.remove()
    for module, forward in undo.blocks:
        del module._remat_policy
        if forward is _NONE:
            del module.forward
        else:
            module.forward = forward
    return model


_NONE = object()  # a block without a forward of its own (the class's runs)


class _Applied:
    """What `apply_eager` changed on a model, for `remove_eager`."""

    def __init__(self):
        self.handles: list = []
        self.blocks: list[tuple[torch.nn.Module, Any]] = []


class _Turn:
    """Which run of a module called several times in a step its next planned call is, and
    whether a call of the planned model is running (where a run past the last is an error)."""

    next = 0
    in_model_call = False


def _in_turn(module: torch.nn.Module, forward, runs: tuple, turn: _Turn,
             offloads: EagerOffloads | None, *args, **kwargs):
    planned = next(p for p in runs if p is not None)
    if not records_graph(module.parameters(), args, kwargs) or \
            not _in_mode(current(planned), module):
        # Not the planned step (no_grad, the other mode): runs plainly, and takes no turn.
        return _checkpointed(module, forward, planned, offloads, *args, **kwargs)
    if turn.in_model_call and turn.next >= len(runs):
        path = current(planned).path
        raise RematError(
            f"block {path!r} runs a {_ordinal(turn.next + 1)} time in this call of the model, "
            f"but the plan has {len(runs)} runs of it (the step it was planned from ran it "
            f"{len(runs)} times): this call is not the step planned (a config or an input "
            "that changes how often the shared module runs?). Plan again with example inputs "
            "that run it as this call does, or apply the plan to a model configured as the "
            "planned one.")
    k, turn.next = turn.next % len(runs), turn.next + 1
    if runs[k] is None:
        return forward(*args, **kwargs)
    return _checkpointed(module, forward, runs[k], offloads, *args, **kwargs)


def _ordinal(n: int) -> str:
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


def _in_mode(policy: BlockPolicy, module: torch.nn.Module) -> bool:
    return policy.training is None or module.training == policy.training


def _checkpointed(module: torch.nn.Module, forward, planned: Any,
                  offloads: EagerOffloads | None, *args, **kwargs):
    from torch.utils.checkpoint import checkpoint

    if torch.compiler.is_compiling():  # dynamo traces the block (remat.fx_passes.eager.traced)
        return traced_checkpoint(module, forward, planned, *args, **kwargs)
    policy = current(planned)  # the block's policy for the call's shapes
    if not records_graph(module.parameters(), args, kwargs):
        return forward(*args, **kwargs)
    if not _in_mode(policy, module):
        return refuse_backward(forward(*args, **kwargs), wrong_mode_message(
            policy.training, module.training, f"block {policy.path!r}: "))
    autocast = autocast_state()  # read here: inside dispatch, autocast reads as off
    refused = autocast_cause(planned, autocast)  # before any op of the block runs
    if refused is not None:
        raise RematError(refused)

    if offloads is None and not policy.cache and _CHECKED.get(id(policy)) is policy:
        # Nothing cached, and the block's ops were checked against the plan at an earlier
        # call: plain checkpoint, without selective checkpoint's per-op dispatch.
        with uncached_autocast():
            return checkpoint(forward, *args, use_reentrant=False,
                              context_fn=partial(_state_kept_only, policy, module), **kwargs)

    counters: list[Any] = []

    def contexts():
        counter = itertools.count()
        counters.append(counter)
        # The recomputation leaves the buffers as the forward left them (BatchNorm's running
        # statistics updated once, as eager PyTorch does).
        return with_state_kept(policy_contexts(
            policy, counter, lambda: mismatch_cause(planned, module, autocast)), module,
            policy.ops)

    # Offload: saved-tensor hooks around checkpoint's call, so that they see the
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
        _CHECKED[id(policy)] = policy
    return out


# The policies whose block ran (and matched the plan op for op) at least once: a policy that
# caches nothing then runs as plain checkpoint (`_checkpointed`). Selective checkpoint's own
# dispatch costs tens of microseconds per op, in the forward and in the recomputation
# (benchmarks/eager_overhead.py), while a policy that caches nothing decides nothing; the
# call guard still checks every call's inputs, flags and autocast against the plan's.
_CHECKED: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def _state_kept_only(policy: BlockPolicy, module: torch.nn.Module):
    """Plain checkpoint's contexts: the recomputation keeps the buffers as the forward left
    them where the block writes into them (batch norm), and adds nothing elsewhere."""
    return with_state_kept((contextlib.nullcontext(), contextlib.nullcontext()), module,
                           policy.ops)
