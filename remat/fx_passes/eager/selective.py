"""A block's plan as the selective-checkpoint policy torch runs: `policy_contexts` turns a
`BlockPolicy` into the contexts `torch.utils.checkpoint(context_fn=...)` takes, the same in
eager mode (`remat.fx_passes.eager.apply`) and under torch.compile
(`remat.fx_passes.eager.traced`)."""
from __future__ import annotations

import itertools

from remat.errors import RematError
from remat.fx_passes.eager.block_policy import BlockPolicy, canonical

__all__ = ["policy_contexts"]


def policy_contexts(policy: BlockPolicy, counter, cause=lambda: ""):
    """The (forward, recomputation) contexts of `torch.utils.checkpoint` that run `policy`:
    the k-th op the block dispatches (counted by `counter`) is cached when the plan caches
    position k and recomputed otherwise; an op other than the planned one at its position is
    a RematError naming the block (`cause`: why the run may differ from the plan's capture)."""
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
