"""The checks of a planned eager training call, and the policy each block runs for its shapes.

An eager plan made with a call spec (`remat.fx_passes.tracing.call_checks.CallSpec`) checks
every training call of the model, in a forward pre-hook on the model itself, before anything
runs: the inputs' names, dtypes and shapes (within the planned range), the parameters that
require grad and their dtypes. The autocast state is checked by each block as it starts
(`autocast_cause`): a forward that accelerate wraps in its autocast (the Trainer's ``bf16=True``)
runs under it, the model's pre-hook outside it. A plan for a range of shapes has one policy per
block for each bucket of the range (eager PyTorch dispatches other ops where a size is 1: a
``contiguous()`` that copies at batch 8 does nothing at batch 1), and the hook tells the blocks
which bucket the call is in.

`GuardedPolicy` is plain data (picklable, like `BlockPolicy`): plan on one rank, send
``plan.block_policies`` to the others, and `apply_eager` installs the same checks there.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from remat.errors import RematError
from remat.fx_passes.eager.block_policy import BlockPolicy
from remat.fx_passes.tracing.call_checks import CallSpec
from remat.fx_passes.tracing.plain import records_graph

__all__ = ["GuardedPolicy", "Selection", "autocast_cause", "current", "guard_calls",
           "mismatch_cause"]


@dataclass(frozen=True)
class GuardedPolicy:
    """A block's policy for each bucket of the planned range (one, keyed None, for fixed
    shapes), and the spec of the planned call."""

    path: str
    by_bucket: tuple[tuple[Any, BlockPolicy], ...]
    spec: CallSpec

    def policy(self, bucket: Any) -> BlockPolicy:
        """The policy for the call's bucket (None: no call check ran, as for a block called
        alone: the plan's own, the first)."""
        if bucket is None:
            return self.by_bucket[0][1]
        table = dict(self.by_bucket)
        if bucket not in table:
            raise RematError(f"block {self.path!r}: the plan has no policy for {bucket}; plan "
                             "the range the model is called with")
        return table[bucket]


@dataclass
class Selection:
    """The bucket of the call in progress, shared by a model's blocks (set by the hook)."""

    bucket: Any = None


@dataclass(frozen=True)
class _Selected:
    guarded: GuardedPolicy
    selection: Selection = field(compare=False)


def current(policy: Any) -> BlockPolicy:
    """The BlockPolicy a wrapped block runs now."""
    if isinstance(policy, _Selected):
        return policy.guarded.policy(policy.selection.bucket)
    return policy


def guard_calls(model: torch.nn.Module, policies: dict[str, Any],
                handles: list | None = None) -> dict[str, Any]:
    """Install the planned call's checks on `model` when `policies` carry a spec, and return
    what each block's wrapper consults (its policy, or its policy per bucket). The hook's
    handle is appended to `handles`."""
    guarded = [p for p in policies.values() if isinstance(p, GuardedPolicy)]
    if not guarded:
        return dict(policies)
    if len(guarded) != len(policies):
        raise RematError("apply_eager: mix of guarded and plain block policies; pass one "
                         "plan's block_policies")
    spec = guarded[0].spec
    selection = Selection()

    def check(module, args, kwargs):
        # A call that records no graph (no_grad, nothing requiring grad), or in the other
        # train/eval mode, is not the planned step: the blocks run it plainly (apply.py).
        if module.training == spec.training and records_graph(module.parameters(), args,
                                                              kwargs):
            spec.check(module, args, kwargs, autocast=False)  # the blocks check autocast
        shapes = spec.shape_range
        if shapes is not None:
            try:
                selection.bucket = shapes.bucket_of(shapes.sizes_of(args, kwargs),
                                                    shapes.padded(args, kwargs))
            except KeyError:  # outside the range: not a planned training call (checked above)
                selection.bucket = None
        return None

    handle = model.register_forward_pre_hook(check, with_kwargs=True)
    if handles is not None:
        handles.append(handle)
    return {path: _Selected(p, selection) for path, p in policies.items()}


def autocast_cause(policy: Any, autocast: tuple) -> str | None:
    """Why a block of a guarded plan, entered under `autocast`, does not run the planned
    step's autocast; None where it does, or where the policy carries no call spec."""
    if not isinstance(policy, _Selected):
        return None
    cause = policy.guarded.spec.autocast_cause(autocast)
    return f"block {policy.guarded.path!r}: {cause}" if cause else None


def mismatch_cause(policy: Any, block: torch.nn.Module | None,
                   autocast: tuple = ()) -> str:
    """Why a block's ops may differ from its plan's, where the planned call says: appended to
    the error of a block whose run dispatches other ops. `autocast`: the state the block was
    called in (read on entry: inside dispatch, autocast reads as off)."""
    if not isinstance(policy, _Selected):
        return ("; plan.apply(model) checks the call's inputs, autocast and parameters before "
                "it runs, apply_eager with plain policies does not")
    spec = policy.guarded.spec
    cause = spec.autocast_cause(autocast)
    if cause is None and isinstance(block, torch.nn.Module):
        cause = spec.parameters_cause(block, prefix=policy.guarded.path + ".")
    return f"; the cause: {cause}" if cause else ""
