"""Tensors that eager PyTorch makes and holds although no op reads them: the joint graph drops
them as dead code, so the eager timeline would not count them (`EagerBlocks.unused_tensors`).

Swin's stages return their hidden states reshaped for ``output_hidden_states`` (a contiguous
copy) whether they are asked for or not, and the encoder's loop variable holds each until the
next stage returns; Gemma-3 makes a full-attention mask and a sliding-window one, and holds both
in a dict until its forward returns, where the tester's two layers read only the second. The
probe (`remat.fx_passes.eager.probe`) watches every op of its forward with `UnusedTracker`: a
storage that an op makes, that no later op reads (a view of it, or an in-place write into it,
is no read), and that is freed before the model's forward returns (what autograd saves, and
the outputs, live on) is such a tensor. `unused_tensors` places each on the joint graph's
forward ops, from the matched op before it to the one its free follows, rounding outward
where the ops outside the blocks are not matched.
"""
from __future__ import annotations

import weakref
from typing import Mapping, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from remat.fx_passes.eager.block_policy import BlockPolicy

__all__ = ["UnusedTracker", "unused_tensors"]

Place = tuple  # (call, k): in the call-th block call of the step (in order) after k of its
# block's observed ops (counted over all of the block's calls); k None: after the call returned;
# (0, -1): before the first call began.


class UnusedTracker(TorchDispatchMode):
    """Entered around one forward, below the blocks' own modes: sees every op, in and out of
    the blocks. `enter(position)` and `leave()` bracket each block call (`position()` counts
    the running block's observed ops); `made(k, output)` says that the block's op at position
    k made `output`; `done()` once the forward has returned. `found` is then (bytes, made,
    freed) per unused tensor (`Place`s)."""

    def __init__(self) -> None:
        super().__init__()
        self.found: list[tuple[int, Place, Place]] = []
        self.calls = 0  # block calls begun
        self.position = None  # the running call's count of observed ops, or None outside
        self.finished = False
        # storage -> [bytes, call, k, read]; k _PENDING until the block's mode names the op
        self.records: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def place(self) -> Place:
        if self.position is not None:
            return self.calls - 1, self.position()
        return (self.calls - 1, None) if self.calls else (0, -1)

    def enter(self, position) -> None:
        self.calls += 1
        self.position = position

    def leave(self) -> None:
        self.position = None

    def done(self) -> None:
        self.finished = True

    def made(self, k: int, output) -> None:
        for t in tree_flatten(output)[0]:
            record = self.records.get(_storage(t))
            if record is not None and record[2] is _PENDING:
                record[2] = k

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        inputs = {s for s in map(_storage, tree_flatten((args, kwargs))[0]) if s is not None}
        out = func(*args, **(kwargs or {}))
        outputs = {s for s in map(_storage, tree_flatten(out)[0]) if s is not None}
        for s in inputs - outputs:  # a view or an in-place write is no read
            record = self.records.get(s)
            if record is not None:
                record[3] = True
        for s in outputs - inputs:
            if s not in self.records:
                call, k = self.place()
                record = [s.nbytes(), call, _PENDING if self.position is not None else k,
                          False]
                self.records[s] = record
                weakref.finalize(s, self._freed, record)
        return out

    def _freed(self, record: list) -> None:
        size, call, k, read = record
        if not read and not self.finished:
            # An op the block's mode passed over (none allocates): after the block's ops.
            self.found.append((size, (call, None if k is _PENDING else k), self.place()))


_PENDING = object()


def unused_tensors(found: Sequence[tuple[int, Place, Place]], order: Sequence[tuple[str, int]],
                   policies: Mapping[str, BlockPolicy], starts: Mapping[str, Sequence[int]],
                   ops: Mapping[str, Sequence[int]], run_of, num_forward: int
                   ) -> tuple[tuple[int, int, int, bool], ...]:
    """`EagerBlocks.unused_tensors` of the probe's `found` (`UnusedTracker`): `order`, the
    (module path, call) of each block call in the step's order; `policies`, each path's aligned
    policy over all its calls (`starts`: where each call began in it); `ops`, each block's
    forward ops, named by `run_of(path, call)`. A tensor made at a matched op is the op's own
    (its forward life is `forward_life`'s within the call): counted only beyond the call."""

    def latest(path: str, call: int, k: int | None = None) -> int | None:
        """The latest joint op run by the call's ops before position k (None: to the call's
        end), where positions count the path's observed ops over all its calls; None where
        none is matched."""
        bounds = [*starts[path], len(policies[path].joint)]
        joint = policies[path].joint[bounds[call]:bounds[call + 1] if k is None else k]
        return max((j for js in joint for j in js), default=None)

    def block(g: int) -> Sequence[int]:
        return ops[run_of(*order[g])]

    kept = []
    for size, (g, k), (h, f) in found:
        in_block = k is not None and k >= 0
        joint = policies[order[g][0]].joint
        if in_block and k < len(joint) and joint[k]:
            if h == g and f is not None:
                continue  # freed in its own call: forward_life holds it
            first = latest(*order[g]) + 1
            in_block = False  # the recomputation's copy is the op's own too
        elif in_block:
            after = latest(*order[g], k)
            first = min(block(g)) if after is None else after
        elif k is None:
            first = max(block(g)) + 1
        else:
            first = 0
        if f is None:  # after call h returned, before the next began
            last = min(block(h + 1)) - 1 if h + 1 < len(order) else num_forward - 1
        elif f < 0:
            last = min(block(h)) - 1
        else:
            before = latest(*order[h], f)
            last = min(block(h)) if before is None else before
        first = min(first, num_forward - 1)
        if last >= first and size:
            kept.append((size, first, last, in_block))
    return tuple(kept)


def _storage(t):
    if not isinstance(t, torch.Tensor) or t.untyped_storage().nbytes() == 0:
        return None
    return t.untyped_storage()
