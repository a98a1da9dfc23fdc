"""What eager PyTorch really does in each block: the ops it dispatches and how long their
outputs live, recorded by running the model's forward once, and matched to the joint graph.

Joint graphs reorder and share some ops (CSE of a causal mask between blocks), so the policy
follows the recorded sequence (`aligned`). And Python variables keep tensors alive beyond their
last use, until the block's forward returns (``q, k = rotate(q), rotate(k)`` holds both
through attention): the recorded lifetimes tell the eager model how long the forward really
holds what the policy does not cache.

The joint graph is functional, so it cannot say which tensors eager PyTorch overwrites in
place; the probe sees it: Mixtral's router normalizes ``topk``'s values with ``/=``,
DeepSeek-V3 fills a ``new_empty`` buffer through ``copy_`` into slices, T5 adds to its
position buckets with ``+=``. Checkpoint refuses a cached tensor that was mutated after it was
cached, and a cached in-place op would skip its write in the recomputation: the probe names
both (`mutated`), and `aligned` never lets the policy cache them.

And eager PyTorch makes tensors that no op reads, which the joint graph drops as dead code:
the probe's `remat.fx_passes.eager.unused.UnusedTracker` finds those a Python variable holds.
"""
from __future__ import annotations

import contextlib
import difflib
import logging
import weakref
from dataclasses import dataclass, replace
from typing import Any, Iterable, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from remat.fx_passes.eager.block_policy import BlockPolicy, canonical, counterpart
from remat.fx_passes.eager.recompute_state import written_positions
from remat.fx_passes.eager.unused import Unused, UnusedTracker, plain_storage
from remat.fx_passes.measuring.storage import held_bytes

log = logging.getLogger(__name__)

__all__ = ["Observed", "aligned", "probe"]

# Below this share of matched ops, a block runs other code in eager PyTorch than captured.
DIFFERENT_CODE = 0.9


@dataclass(frozen=True)
class Observed:
    """What one block did in the probe's forward."""

    ops: list[str]
    """The ops eager PyTorch dispatched, in order (canonical names)."""
    freed: list[int]
    """For each op, how many of the block's ops had run when its output was freed (the
    block's op count when it outlived the block's forward)."""
    mutated: set[int]
    """Positions whose output an in-place op overwrites later, or that write in place."""
    unread: tuple[tuple[int, int, int], ...] = ()
    """(storage, bytes, call) of tensors the block was called with but never read (position
    ids that the rotary embedding outside the block used): checkpoint keeps them all the
    same. Storages are numbered across blocks (one passed to every block has one number); the
    model's inputs, parameters and buffers are left out (the static term)."""
    calls: tuple[int, ...] = (0,)
    """Where each call of the block began in `ops`: a module called several times in one step
    (ALBERT's shared layer) is a block with several runs."""
    nbytes: tuple[int, ...] = ()
    """For each op, the bytes of the one tensor it returned in a storage of its own (0: a view,
    in place, several outputs or none). Eager PyTorch can make other shapes than the capture:
    transformers passes no attention mask when the padding mask is all ones, a branch it
    never takes while tracing, so the capture broadcasts its mask over the batch."""
    order: tuple[int, ...] = ()
    """Each call's place among all the blocks' calls of the step, in the order they ran."""
    unused: Unused | None = None
    """The tensors of the step that no op read and that were freed before the forward
    returned, and the ops outside the blocks: one for all the blocks
    (`remat.fx_passes.eager.unused`)."""
    writes_input: tuple[tuple[int, str], ...] = ()
    """(position, op) of the ops that wrote in place into a tensor the block was called with
    (a block that is an ``nn.ReLU(inplace=True)`` alone): checkpoint saves the block's inputs
    and refuses them at backward once overwritten, so such a block cannot be checkpointed."""


def probe(model: torch.nn.Module, inputs: Sequence[Any], paths: Sequence[str],
          kwargs: dict[str, Any] | None = None) -> dict[str, Observed]:
    """Per block, what eager PyTorch did in one forward (`Observed`). The generator and the
    buffers are put back afterwards: nothing changes."""
    from torch.utils.checkpoint import checkpoint

    seen: dict[str, list[str]] = {p: [] for p in paths}
    freed: dict[str, list[int]] = {p: [] for p in paths}
    alive: dict[str, list[int]] = {p: [] for p in paths}  # outputs of each op not yet freed
    mutated: dict[str, set[int]] = {p: set() for p in paths}
    unread: dict[str, list[tuple[int, int, int]]] = {p: [] for p in paths}
    calls: dict[str, list[int]] = {p: [] for p in paths}
    nbytes: dict[str, list[int]] = {p: [] for p in paths}
    order: dict[str, list[int]] = {p: [] for p in paths}
    writes_input: dict[str, list[tuple[int, str]]] = {p: [] for p in paths}
    # storage -> (block, position) of every block op whose output lives in it, across the
    # blocks: a later block or an op outside the blocks may overwrite it in place
    made_anywhere: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
    tracker = UnusedTracker()
    static = weakref.WeakSet(_storage(t) for t in [*tree_flatten((inputs, kwargs))[0],
                                                   *model.parameters(), *model.buffers()]
                             if _storage(t) is not None)
    numbers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
    read: weakref.WeakSet = weakref.WeakSet()
    saved = {n: b.detach().clone() for n, b in model.named_buffers()}
    originals = {}

    def recorder(path, forward):
        def contexts():
            from torch.utils.checkpoint import (CheckpointPolicy,
                                                create_selective_checkpoint_contexts)

            def record(ctx, op, *args, **kwargs):
                seen[path].append(canonical(str(op)))
                freed[path].append(-1)
                nbytes[path].append(0)
                alive[path].append(0)
                return CheckpointPolicy.PREFER_RECOMPUTE

            def watch(k, output, given):
                tracker.made(k, output)
                tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor)]
                for t in tensors:
                    alive[path][k] += 1
                    weakref.finalize(t.untyped_storage(), _note, freed[path], alive[path],
                                     seen[path], k)
                # A wrapper subclass (DTensor) has its whole logical size, not the local
                # tensor's bytes the graph counts: the graph's bytes stand for it.
                own = [plain_storage(t) for t in tensors]
                if len(own) == 1 and own[0] is not None and all(own[0] is not g for g in given):
                    nbytes[path][k] = held_bytes(own[0])

            caching, recompute = create_selective_checkpoint_contexts(record)

            @contextlib.contextmanager
            def forward_context():  # ours above the caching mode: ops reach ours first
                with caching, _Outputs(seen[path], watch, mutated[path], read, static,
                                       writes_input[path], made_anywhere, path):
                    yield

            return forward_context(), recompute

        def run(*a, **k):
            given = {s for s in map(_storage, tree_flatten((a, k))[0])
                     if s is not None and s not in static}
            read.clear()
            calls[path].append(len(seen[path]))
            order[path].append(len(tracker.segments) - 1)
            tracker.enter(lambda: len(seen[path]))
            try:
                out = checkpoint(forward, *a, use_reentrant=False, context_fn=contexts, **k)
            finally:
                tracker.leave()
            # What is still alive when the block returns lives to its end at least.
            freed[path][:] = [len(seen[path]) if n > 0 else f
                              for f, n in zip(freed[path], alive[path])]
            for storage in given - set(read):
                number = numbers.setdefault(storage, len(numbers))
                unread[path].append((number, held_bytes(storage), len(calls[path]) - 1))
            return out

        return run

    try:
        for path in paths:
            module = model.get_submodule(path)
            originals[path] = module.__dict__.get("forward")
            module.forward = recorder(path, module.forward)
        # The generators the forward's random ops draw from: the CPU's, and each GPU's the
        # model is on (fork_rng(devices=[]) forks the CPU's alone).
        gpus = sorted({p.device.index or 0 for p in model.parameters() if p.is_cuda})
        with torch.random.fork_rng(devices=gpus), torch.enable_grad(), tracker, \
                _Writes(made_anywhere, mutated):
            out = model(*inputs, **(kwargs or {}))
            tracker.done()  # what is freed from here on was held past the forward
            del out
    finally:
        for path, forward in originals.items():
            module = model.get_submodule(path)
            if forward is None:
                del module.forward
            else:
                module.forward = forward
        with torch.no_grad():
            for name, buffer in model.named_buffers():
                buffer.copy_(saved[name])
    unused = tracker.result()
    return {p: Observed(seen[p], freed[p], mutated[p], tuple(unread[p]),
                        tuple(calls[p]) or (0,), tuple(nbytes[p]), tuple(order[p]), unused,
                        writes_input=tuple(writes_input[p]))
            for p in paths}


class _Outputs(TorchDispatchMode):
    """Hands `watch(k, output, given)` the output of the k-th op the policy was called for and
    the storages of its arguments, and adds to `mutated` the positions whose output an in-place
    op overwrites (every earlier position whose output lives in the storage it writes) and the
    in-place op's own. Entered
    above the selective-checkpoint mode, each op passes here on its way to the policy and its
    output comes back here. torch 2.13 also gives the policy the output (`ctx.op_output`), but
    2.11 calls the policy before the op runs; this works on both. Ops the policy is not
    called for (checkpoint's own detaches) are passed over."""

    def __init__(self, seen: list[str], watch, mutated: set[int], read, static,
                 writes_input: list[tuple[int, str]], made_anywhere, path: str) -> None:
        super().__init__()
        self.seen, self.watch, self.mutated, self.read = seen, watch, mutated, read
        self.static, self.writes_input = static, writes_input
        self.made_anywhere, self.path = made_anywhere, path
        # storage -> the positions whose outputs live in it; weak, so a storage freed and an
        # address reused later are not confused
        self.made: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before = len(self.seen)
        given = [s for s in map(_storage, tree_flatten((args, kwargs))[0]) if s is not None]
        self.read.update(given)
        targets = [s for s in map(_storage, _written(func, args, kwargs or {})) if s is not None]
        written = [self.made.get(storage, ()) for storage in targets]
        # A tensor the block did not make, nor a parameter or buffer: one it was called with
        # (or a view of one).
        foreign = any(s not in self.made and s not in self.static for s in targets)
        out = func(*args, **(kwargs or {}))
        if len(self.seen) == before + 1:
            self.watch(before, out, given)
            for t in tree_flatten(out)[0]:
                storage = _storage(t)
                if storage is not None:
                    self.made[storage] = (*self.made.get(storage, ()), before)
                    self.made_anywhere[storage] = (*self.made_anywhere.get(storage, ()),
                                                   (self.path, before))
            if _written(func, args, kwargs or {}):
                self.mutated.add(before)
            if foreign:
                self.writes_input.append((before, self.seen[before]))
        for positions in written:
            self.mutated.update(positions)
        return out


class _Writes(TorchDispatchMode):
    """Over the whole forward: adds to each block's `mutated` the positions whose output an
    in-place op overwrites later anywhere in the step, in a later block or outside the blocks
    (a block's output that an ``nn.ReLU(inplace=True)`` after it overwrites): selective
    checkpoint refuses a cached tensor that was mutated."""

    def __init__(self, made_anywhere, mutated: dict[str, set[int]]) -> None:
        super().__init__()
        self.made_anywhere, self.mutated = made_anywhere, mutated

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for storage in map(_storage, _written(func, args, kwargs or {})):
            if storage is not None:
                for path, position in self.made_anywhere.get(storage, ()):
                    self.mutated[path].add(position)
        return func(*args, **(kwargs or {}))


def _storage(t: Any):
    """The storage of tensor `t` (torch keeps one Python object per storage while it lives,
    so it keys a weak dictionary), or None for a non-tensor or an empty storage."""
    if not isinstance(t, torch.Tensor) or t.untyped_storage().nbytes() == 0:
        return None
    return t.untyped_storage()


def _written(func, args, kwargs) -> list[torch.Tensor]:
    """The tensors op `func` writes into (in-place and out= arguments, by its schema)."""
    written = []
    for where in written_positions(func, args, kwargs, unmarked=False):
        value = args[where] if isinstance(where, int) else kwargs[where]
        written.extend(t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor))
    return written


def _note(freed: list[int], alive: list[int], seen: list[str], k: int) -> None:
    """An output of op `k` was freed: the op's tensors live until the last of them goes."""
    alive[k] -= 1
    freed[k] = len(seen)


def aligned(policy: BlockPolicy, observed: Sequence[str], freed: Sequence[int] = (),
            mutated: Iterable[int] = (), nbytes: Sequence[int] = ()) -> BlockPolicy:
    """The block's policy over the ops eager PyTorch really dispatches, each matched to the
    joint-graph ops it stands for where the two sequences agree (difflib's longest matching
    blocks; an in-place op matches its functional counterpart, `counterpart`); an eager op
    without a match is never cached, a joint op without one is not
    cacheable. `freed` (from `probe`) gives each matched joint op its forward lifetime; the
    `mutated` positions (overwritten in place later, or writing in place) are never cached;
    `nbytes` the bytes eager made for a matched op that stands for one joint op
    (`BlockPolicy.eager_bytes`)."""
    matcher = difflib.SequenceMatcher(a=[counterpart(o) for o in policy.ops],
                                      b=[counterpart(o) for o in observed], autojunk=False)
    joint: list[tuple[int, ...]] = [()] * len(observed)
    cacheable = [False] * len(observed)
    for block in matcher.get_matching_blocks():
        for k in range(block.size):
            joint[block.b + k] = policy.joint[block.a + k]
            cacheable[block.b + k] = policy.cacheable[block.a + k] and block.b + k not in mutated
    matched = sum(b.size for b in matcher.get_matching_blocks())
    # Eager ops without a counterpart that make no bytes (batch norm's empty reserve tensor
    # on the CPU) cannot move the memory predicted: they do not count as other code.
    empty = sum(1 for k, ops in enumerate(joint) if not ops and k < len(nbytes)
                and nbytes[k] == 0 and observed[k] == "aten.empty.memory_format")
    if matched < DIFFERENT_CODE * max(len(observed) - empty, len(policy.ops)):
        log.warning(
            "block %r: only %d of its %d eager ops match the %d of the captured graph: eager "
            "PyTorch runs other code in this block than the capture did under torch.compile "
            "(code that branches on tracing: the scan of transformers' Mamba models with "
            "config.use_associative_scan; transformers' sdpa attention with fewer key/value "
            "heads than heads, which repeats them when traced and passes enable_gqa when the "
            "attention mask it drops outside tracing is absent); the eager plan's memory is "
            "predicted from the captured graph and can be off either way; make the model take "
            "one path (for Mamba models, use_associative_scan=False)", policy.path, matched,
            len(observed), len(policy.ops))
    elif matched < len(observed):
        log.info("block %r: %d of its %d eager ops have no counterpart in the joint graph; "
                 "they are recomputed, never cached", policy.path, len(observed) - matched,
                 len(observed))
    # The latest joint op run by each eager position: where a freed tensor's life ends.
    latest, running = [], -1
    for ops in joint:
        running = max([running, *ops])
        latest.append(running)
    life = tuple((j, latest[freed[k] - 1]) for k, ops in enumerate(joint) if k < len(freed)
                 and freed[k] > 0 and latest[freed[k] - 1] >= 0 for j in ops)
    made = tuple((ops[0], nbytes[k]) for k, ops in enumerate(joint)
                 if len(ops) == 1 and k < len(nbytes) and nbytes[k] > 0)
    return replace(policy, ops=tuple(observed), joint=tuple(joint),
                   cacheable=tuple(cacheable), life=life, eager_bytes=made)
