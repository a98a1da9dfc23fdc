"""What one block's selective-checkpoint policy expects and caches, as plain data: made by the
planner (`remat.fx_passes.eager.policy`), matched against what eager PyTorch dispatches
(`remat.fx_passes.eager.probe`), and applied to the model on every rank
(`remat.fx_passes.eager.apply`). Picklable, so one rank can plan and send it to the others."""
from __future__ import annotations

from dataclasses import dataclass, replace

__all__ = ["BlockPolicy", "canonical", "counterpart", "with_cache", "with_offload"]


# Ops that functionalization turns into others: compared as one.
_SAME = {"aten._unsafe_view.default": "aten.view.default",
         "aten.lift_fresh_copy.default": "aten.lift_fresh.default"}


def canonical(op_name: str) -> str:
    """An op's name as both sides compare it (`_SAME`)."""
    return _SAME.get(op_name, op_name)


# Eager batch norm and the op the capture decomposes it into (its running statistics updated
# functionally): one op on both sides, by backend.
_BATCH_NORM = "batch_norm"
_BATCH_NORMS = {"aten.native_batch_norm.default", "aten.cudnn_batch_norm.default",
                "aten.miopen_batch_norm.default", "aten._native_batch_norm_legit.default",
                "aten._native_batch_norm_legit.no_stats",
                "aten._native_batch_norm_legit_functional.default",
                "aten._native_batch_norm_legit_no_training.default"}


def counterpart(op_name: str) -> str:
    """The name an eager op shares with its joint-graph counterpart, where eager and the
    functional capture dispatch different ops for one computation: an in-place op
    (``aten.relu_.default``, ``nn.ReLU(inplace=True)``; ``aten.add_.Tensor``, BatchNorm's
    ``num_batches_tracked += 1``) and the out-of-place op functionalization turns it into,
    eager batch norm and ``_native_batch_norm_legit_functional``. Used only to match the two
    sequences (`remat.fx_passes.eager.probe.aligned`): the policy keeps the names eager
    dispatches."""
    name = canonical(op_name)
    if name in _BATCH_NORMS:
        return _BATCH_NORM
    namespace, _, rest = name.partition(".")
    base, dot, overload = rest.partition(".")
    if base.endswith("_") and not base.endswith("__"):
        return f"{namespace}.{base[:-1]}{dot}{overload}"
    return name


@dataclass(frozen=True)
class BlockPolicy:
    """What one block's policy expects and caches: `ops[k]` is the k-th op the policy is
    called for (canonical name), `joint[k]` the joint-graph ops it stands for, `cache` the
    positions it caches."""

    path: str
    ops: tuple[str, ...]
    joint: tuple[tuple[int, ...], ...]
    cacheable: tuple[bool, ...]
    made_after: tuple[tuple[int, int], ...] = ()
    """(joint op, joint op): eager makes the first after the second (CPU dropout's output
    after its noise)."""
    life: tuple[tuple[int, int], ...] = ()
    """(joint op, joint op): in the probe, the first's tensor lived until the second ran
    (Python variables keep tensors beyond their last use, until the block returns)."""
    eager_bytes: tuple[tuple[int, int], ...] = ()
    """(joint op, bytes): in the probe, eager made the op's tensor in a storage of that size,
    which can differ from the capture's (a mask that eager does not broadcast over the
    batch); the eager problem takes it (`remat.fx_passes.eager.policy.with_eager_bytes`)."""
    cache: frozenset[int] = frozenset()
    training: bool | None = None
    """The block's mode (``module.training``) the plan was made in; None if unknown. A block
    called in the other mode runs without the plan, and a backward through it is refused."""
    keep: frozenset[int] = frozenset()
    """Positions cached whatever the plan says: routing decisions (top-k, argmax, nonzero),
    which a recomputation must not make again (`remat.solvers.Reason.DATA`), and in a plan
    made for torch.compile its random draws (`Reason.COMPILED_DRAW`)."""
    prefer_save: bool = False
    """Under torch.compile, whether cached positions are PREFER_SAVE rather than MUST_SAVE
    (`remat.fx_passes.eager.traced`): set for plans made with compile=True or "blocks", read
    under Inductor, whose min-cut partitioner may recompute a cached pointwise op fused into
    its backward readers. AOTAutograd's default partition does not support PREFER_SAVE where
    a recomputation reads the op ("Node ... was invalid, but is output")."""
    offload: tuple[tuple[tuple[int, ...], str], ...] = ()
    """(shape, dtype) of the block's inputs that checkpoint's frame keeps in host memory
    (`remat.fx_passes.eager.offload`)."""
    prefetch: tuple[str, ...] = ()
    """Blocks whose offloaded inputs are loaded back when this block's checkpoint unpacks its
    own inputs (its recomputation's start): one block ahead of their need."""


def with_offload(policy: BlockPolicy, offload: tuple, prefetch: tuple[str, ...]) -> BlockPolicy:
    """The block's policy offloading inputs of shapes and dtypes `offload` and loading those
    of the blocks `prefetch` when it unpacks."""
    return replace(policy, offload=tuple(offload), prefetch=tuple(prefetch))


def with_cache(policy: BlockPolicy, cached: frozenset[int]) -> BlockPolicy:
    """The block's policy caching the positions whose joint ops are in `cached`, and the
    positions it always keeps."""
    cache = frozenset(k for k, (joint, ok) in enumerate(zip(policy.joint, policy.cacheable))
                      if ok and (k in policy.keep or any(j in cached for j in joint)))
    return replace(policy, cache=cache)
