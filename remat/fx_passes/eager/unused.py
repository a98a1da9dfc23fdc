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
forward ops, from the matched op before it to the one its free follows (the ops outside the
blocks matched segment by segment, between two block calls), rounding outward where nothing is
matched. The eager timeline holds it from the first op's step (conservative by the inputs that
op frees before it is made) to the last's; one made in a block is made again by the block's
recomputation where that runs past its first op, and held to the recomputation's end.
"""
from __future__ import annotations

import difflib
import weakref
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from remat.fx_passes.eager.block_policy import BlockPolicy, canonical, counterpart
from remat.fx_passes.measuring.storage import held_bytes

__all__ = ["Unused", "UnusedTracker", "unused_tensors"]

Place = tuple
"""(True, call, k): in the call-th block call of the step (in order), after k of its module's
observed ops (counted over all of the module's calls); (False, segment, j): outside the blocks,
after j ops of the segment that runs before the segment-th call (after the last call: the
segment numbered the count of calls)."""


@dataclass(frozen=True)
class Unused:
    """What `UnusedTracker` found in one forward: per unused tensor (bytes, where it was made
    (after the op that made it), where it was freed), and the ops of each segment outside the
    blocks (canonical names), by which the places outside are matched to the joint graph."""

    found: tuple[tuple[int, Place, Place], ...]
    segments: tuple[tuple[str, ...], ...]


class UnusedTracker(TorchDispatchMode):
    """Entered around one forward, below the blocks' own modes: sees every op, in and out of
    the blocks. `enter(position)` and `leave()` bracket each block call (`position()` counts
    the module's observed ops); `made(k, output)`, from the block's own mode, says that its
    op at position k made `output`; `done()` once the forward has returned. `result()`
    is then the `Unused`."""

    def __init__(self) -> None:
        super().__init__()
        self.found: list[tuple[int, Place, Place]] = []
        self.segments: list[list[str]] = [[]]
        self.position = None  # the running call's count of observed ops; None outside
        self.finished = False
        self.fresh: list[list] = []  # the records of what the last op made
        self.watches: list[weakref.finalize] = []
        # storage -> [bytes, made, read]
        self.records: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def place(self, ahead: int = 0) -> Place:
        g = len(self.segments) - 1  # the running call, or the segment before the next
        if self.position is not None:
            return True, g, self.position()
        return False, g, len(self.segments[-1]) - ahead

    def enter(self, position) -> None:
        self.position = position

    def leave(self) -> None:
        self.position = None
        self.segments.append([])

    def done(self) -> None:
        """What is freed from here on lived past the forward (saved for the backward, an
        output, a module's cache): it does not count."""
        self.finished = True
        for watch in self.watches:
            watch.detach()
        self.watches = []

    def made(self, k: int, output) -> None:
        for s in map(plain_storage, tree_flatten(output)[0]):
            record = None if s is None else self.records.get(s)  # (empty: no storage)
            if record is not None and any(record is r for r in self.fresh):
                record[1] = (True, record[1][1], k)

    def result(self) -> Unused:
        return Unused(tuple(self.found), tuple(map(tuple, self.segments)))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        inputs = {s for s in map(plain_storage, tree_flatten((args, kwargs))[0]) if s is not None}
        out = func(*args, **(kwargs or {}))
        outputs = {s for s in map(plain_storage, tree_flatten(out)[0]) if s is not None}
        for s in inputs - outputs:  # a view or an in-place write is no read
            record = self.records.get(s)
            if record is not None:
                record[2] = True
        if self.position is None:
            self.segments[-1].append(canonical(str(func)))
        new = [s for s in outputs - inputs if s not in self.records]
        if new:  # (the blocks' modes detach what they cache: no new storage)
            self.fresh = []
        for s in new:
            record = [held_bytes(s), self.place(ahead=1), False]
            self.records[s] = record
            self.fresh.append(record)
            self.watches.append(weakref.finalize(s, self._freed, record))
        return out

    def _freed(self, record: list) -> None:
        size, made, read = record
        if not read and not self.finished:
            self.found.append((size, made, self.place()))


def unused_tensors(unused: Unused, order: Sequence[tuple[str, int]],
                   policies: Mapping[str, BlockPolicy], starts: Mapping[str, Sequence[int]],
                   ops: Mapping[str, Sequence[int]], run_of: Callable[[str, int], str],
                   expected: Callable[[Sequence[int]], BlockPolicy], num_forward: int
                   ) -> tuple[tuple[int, int, int, bool], ...]:
    """`EagerBlocks.unused_tensors` of what the probe's tracker found: `order`, the (module
    path, call) of each block call in the step's order; `policies`, each path's aligned policy
    over all its calls (`starts`: where each call began in it); `ops`, each block's forward
    ops, named by `run_of(path, call)`; `expected(members)`, the ops eager PyTorch would
    dispatch for forward ops `members` outside the blocks (`policy.expected_ops`). A tensor
    made at a matched op of a block is the op's own (`forward_life` holds it to the call's
    end): counted only beyond its call."""

    def block(g: int) -> Sequence[int]:
        return ops[run_of(*order[g])]

    def latest(inside: bool, g: int, k: int | None = None) -> int | None:
        """The latest joint op run before position k of call (or segment) g (None: its
        end); None where none is matched."""
        if inside:
            path, call = order[g]
            bounds = [*starts[path], len(policies[path].joint)]
            joint = policies[path].joint[bounds[call]:bounds[call + 1] if k is None else k]
        else:
            joint = outside(g)[:k]
        return max((j for js in joint for j in js), default=None)

    def low(s: int) -> int:  # the first joint op of segment s (the next block's: empty)
        return max(block(s - 1)) + 1 if s > 0 else 0

    segments: dict[int, list[tuple[int, ...]]] = {}

    def outside(s: int) -> list[tuple[int, ...]]:
        """The joint ops of each observed op of segment s, where difflib matches them."""
        if s not in segments:
            high = min(block(s)) - 1 if s < len(order) else num_forward - 1
            policy = expected(range(low(s), high + 1))
            matcher = difflib.SequenceMatcher(a=[counterpart(o) for o in policy.ops],
                                              b=[counterpart(o) for o in unused.segments[s]],
                                              autojunk=False)
            joint = [()] * len(unused.segments[s])
            for m in matcher.get_matching_blocks():
                joint[m.b:m.b + m.size] = policy.joint[m.a:m.a + m.size]
            segments[s] = joint
        return segments[s]

    kept = []
    for size, (inside, g, k), (freed_inside, h, f) in unused.found:
        in_block = inside
        if inside:
            path, _ = order[g]
            if k < len(policies[path].joint) and policies[path].joint[k]:
                if freed_inside and h == g:
                    continue  # freed in its own call: forward_life holds it
                first, in_block = latest(True, g) + 1, False  # its recomputation's too
            else:
                after = latest(True, g, k)
                first = min(block(g)) if after is None else after
        else:
            after = latest(False, g, k + 1)
            first = low(g) if after is None else after
        before = latest(freed_inside, h, f)
        if before is not None:
            last = before
        else:
            last = min(block(h)) if freed_inside else low(h) - 1
        first = min(first, num_forward - 1)
        if last >= first and size:
            kept.append((size, first, last, in_block))
    return tuple(kept)


def plain_storage(t):
    """The storage of tensor `t`, or None: not a tensor, empty, or a wrapper subclass (a
    DTensor's storage has its logical size, and its reads happen on its local tensor, below
    this mode: it would read as made and never read)."""
    if not isinstance(t, torch.Tensor) or (type(t) is not torch.Tensor
                                           and not isinstance(t, torch.nn.Parameter)):
        return None
    try:
        storage = t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None
    return storage if storage.nbytes() else None
