"""A block's plan as the selective-checkpoint policy torch runs: `policy_contexts` turns a
`BlockPolicy` into the contexts `torch.utils.checkpoint(context_fn=...)` takes, the same in
eager mode (`remat.fx_passes.eager.apply`) and under torch.compile
(`remat.fx_passes.eager.traced`); `decider` is the policy function itself, called once per op
the block dispatches (benchmarks/eager_overhead.py times it)."""
from __future__ import annotations

import itertools

from remat.errors import RematError
from remat.fx_passes.eager.block_policy import BlockPolicy, canonical

__all__ = ["decider", "policy_contexts"]

# An op's canonical name by the op object: ``str(op)`` formats the name anew at each call,
# the larger part of the decision's own time. The ops are torch's OpOverload singletons.
_NAMES: dict = {}


def decider(policy: BlockPolicy, counter, cause=lambda: ""):
    """The policy function of `policy_contexts`: the k-th op the block dispatches (counted
    by `counter`) is cached when the plan caches position k and recomputed otherwise; an op
    other than the planned one at its position is a RematError naming the block (`cause`:
    why the run may differ from the plan's capture)."""
    from torch.utils.checkpoint import CheckpointPolicy

    # torch 2.13 asks once per op, in the forward, and replays the answers in the
    # recomputation; 2.11 asks again for each op it recomputes (`ctx.is_recompute`), and
    # must get the forward's answer for the same position.
    recomputed = itertools.count()
    ops, cache = policy.ops, policy.cache
    save, recompute = CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE

    def decide(ctx, op, *args, **kwargs):
        k = next(recomputed if ctx.is_recompute else counter)
        name = _NAMES.get(op)
        if name is None:
            name = _NAMES[op] = canonical(str(op))
        if k >= len(ops) or ops[k] != name:
            expected = ops[k] if k < len(ops) else "nothing more"
            raise RematError(
                f"block {policy.path!r}: op {k} of the run is {name} where the plan's capture "
                f"had {expected}; the block's ops differ between capture and run: plan with "
                f"the inputs and settings you train with{cause()}")
        return save if k in cache else recompute

    return decide


def policy_contexts(policy: BlockPolicy, counter, cause=lambda: ""):
    """The (forward, recomputation) contexts of `torch.utils.checkpoint` that run `policy`
    (`decider`)."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(decider(policy, counter, cause))
