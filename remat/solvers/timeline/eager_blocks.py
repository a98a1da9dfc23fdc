"""The eager mode's blocks: how the step's ops group into checkpointed blocks
(`EagerBlocks`, built by the torch side, which knows the modules and autograd's sequence
numbers), and what each block does in the backward under a selective-checkpoint policy
(`BlockRun`, `block_runs`): the backward op that triggers its recomputation, the forward op
where the recomputation stops, what it runs again and what checkpoint holds for it.
`remat.solvers.timeline.eager` prices these runs; `eager_offload` picks the values a block's
run can send to host."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Iterable, Mapping

from remat.solvers.core.problem import Kind, Problem, recompute_blocker, tuple_of

__all__ = ["BlockRun", "EagerBlocks", "always_cached", "block_runs"]


@dataclass(frozen=True)
class EagerBlocks:
    """How the step's ops group into checkpointed blocks (built by the torch side, which
    knows the modules and autograd's sequence numbers)."""

    ops: Mapping[str, tuple[int, ...]]
    """block name -> its forward ops, in order."""
    owner: Mapping[int, str]
    """backward op -> the block whose autograd nodes it runs (absent: outside every block)."""
    packer: Mapping[int, int] = field(default_factory=dict)
    """backward op -> the last forward op the recomputation must run for it to have what it
    reads (where its autograd node packed it), where known."""
    cacheable: frozenset[int] = frozenset()
    """forward ops whose output the policy may cache: not views, not in-place, not random,
    not overwritten later in the block (caching those breaks checkpoint or the draws)."""
    node_end: Mapping[int, int] = field(default_factory=dict)
    """backward op -> the last backward op of the same autograd node: eager autograd releases
    a node's saved tensors when the node finishes, not after the kernel that last reads them."""
    position: Mapping[int, float] = field(default_factory=dict)
    """forward op -> where eager makes it, where that is not its index: on the CPU a
    dropout's output (a getitem before its mask's) is made by a mul after the noise."""
    forward_life: Mapping[int, int] = field(default_factory=dict)
    """forward op -> the forward op until which eager really holds its tensor (measured:
    Python variables hold tensors past their last use, to the block's return)."""
    state_bytes: int = 0
    """bytes of device memory checkpoint keeps per block from its forward to its end: the
    generator's state (5,056 bytes on a CPU; on CUDA it is kept in host memory)."""
    groups: tuple[tuple[int, ...], ...] = ()
    """ops cached together: the tensors of one eager op with several outputs (layer norm's
    output, mean and rstd), which the policy caches all or none of."""
    python_backward: frozenset[int] = frozenset()
    """backward ops of a backward written in Python (a custom autograd.Function's, BLOOM's
    GeLU): their temporaries die at their last reader, not when the node returns."""
    unread_inputs: tuple[tuple[int, tuple[str, ...]], ...] = ()
    """(bytes, blocks) of a tensor the blocks are called with but never read (position ids):
    checkpoint keeps it from the first block's forward to the end of their backward."""
    kept_numbers: tuple[tuple[int, int, int], ...] = ()
    """(bytes, forward op, backward op) of a Python number that the forward op took as a
    tensor and its autograd node keeps (``x * 0.5``: MulBackward0 saves the 8-byte tensor
    eager PyTorch wrapped 0.5 in, outside checkpoint's hooks, which skip wrapped numbers):
    held after the op's step, its temp, to the end of that backward op's node; and in its
    block's recomputation, from the first step after it to the recomputation's end (measured:
    Gemma-2's softcapping, freed when the recomputed graph is)."""
    unused_tensors: tuple[tuple[int, int, int, bool], ...] = ()
    """(bytes, first op, last op, made in a block): `remat.fx_passes.eager.unused`'s tensors."""
    unpacks: frozenset[int] = frozenset()
    """backward ops of a block that read a tensor its autograd nodes saved which is no op of
    the problem (a weight, an input of the step: Whisper's first convolution saves only
    these): checkpoint packed it all the same, so reading it recomputes the block, and its
    frame (the generator's state) lives to the op's node's end."""

    def block_of(self) -> dict[int, str]:
        return {v: name for name, ops in self.ops.items() for v in ops}

    def unwrapped(self) -> "EagerBlocks":
        """No block checkpointed: the step as eager autograd runs it without a plan, every
        forward value a backward op reads saved by its node, nothing recomputed and nothing
        held by checkpoint (what Python variables and autograd nodes hold is kept; the inputs
        checkpoint alone kept, `unread_inputs`, are not)."""
        return replace(self, ops={}, owner={}, packer={}, cacheable=frozenset(), groups=(),
                       unread_inputs=(), unpacks=frozenset())

    def renumbered(self, index: Mapping[int, int]) -> "EagerBlocks":
        """The same blocks over another numbering of the same ops (`index`: old -> new), such
        as the problem with sharding's collectives inserted (`remat.fx_passes.lowering.sharding`),
        which keeps the forward ops in order."""
        at = lambda v: index[v] if v >= 0 else v  # noqa: E731  (-1: before the first op)

        def moved(p: float) -> float:  # a position between two ops stays between them
            whole = int(p)
            return at(whole) + (p - whole)

        return EagerBlocks(
            ops={n: tuple(map(at, ops)) for n, ops in self.ops.items()},
            owner={at(b): n for b, n in self.owner.items()},
            packer={at(b): at(v) for b, v in self.packer.items()},
            cacheable=frozenset(map(at, self.cacheable)),
            node_end={at(b): at(e) for b, e in self.node_end.items()},
            position={at(v): moved(p) for v, p in self.position.items()},
            forward_life={at(v): at(e) for v, e in self.forward_life.items()},
            state_bytes=self.state_bytes,
            groups=tuple(tuple(map(at, g)) for g in self.groups),
            python_backward=frozenset(map(at, self.python_backward)),
            unread_inputs=self.unread_inputs,
            kept_numbers=tuple((n, at(v), at(b)) for n, v, b in self.kept_numbers),
            unused_tensors=tuple((n, at(a), at(z), m) for n, a, z, m in self.unused_tensors),
            unpacks=frozenset(map(at, self.unpacks)))


@dataclass(frozen=True)
class BlockRun:
    """What one block does in the backward under its policy."""

    name: str
    trigger: int | None  # the backward op before which the block recomputes; None: never
    stop: int | None  # the last forward op the recomputation runs
    recomputed: tuple[int, ...]
    cached: tuple[int, ...]
    inputs: tuple[int, ...]  # forward storages from outside the block that checkpoint holds
    end: int | None
    """The block's last backward op that reads a forward tensor: checkpoint lets the block's
    inputs go after it (the joint graph's trailing views of weight gradients do not count)."""


def block_runs(problem: Problem, blocks: EagerBlocks, cached: Iterable[int]) -> list[BlockRun]:
    """Per block, the trigger, the early stop and what the recomputation runs, for the
    policy that caches exactly `cached` (forward ops, restricted to the cacheable ones) and
    the routing decisions every policy caches (`always_cached`)."""
    cached = (frozenset(cached) & blocks.cacheable) | always_cached(problem, blocks)
    cached |= {v for group in blocks.groups if cached.intersection(group) for v in group}
    nf = problem.num_forward
    root, storage_inputs = problem.root, problem.storage_inputs
    runs = []
    owned: dict[str, list[int]] = {}
    for b, name in blocks.owner.items():
        owned.setdefault(name, []).append(b)
    for name, ops in blocks.ops.items():
        members = set(ops)
        inputs = sorted({s for v in ops for s in storage_inputs[v]
                         if s < nf and s not in members})
        visible = members | set(inputs)
        mine = sorted(owned.get(name, ()))
        reading = [b for b in mine if b in blocks.unpacks
                   or any(root[s] in visible or s in visible
                          for s in storage_inputs[b] if s < nf)]
        if not reading:
            runs.append(BlockRun(name, None, None, (), tuple(sorted(cached & members)),
                                 tuple(inputs), None))
            continue
        stop = max(_pack_position(problem, blocks, b, members, ops[0]) for b in reading)
        recomputed = []
        for v in ops:
            if blocks.position.get(v, v) > stop:
                continue
            op = problem.ops[v]
            if op.kind is Kind.VIEW or v in cached or recompute_blocker(problem, v) is not None:
                continue
            if op.kind is Kind.TUPLE and problem.users[v] and cached.issuperset(problem.users[v]):
                # The policy caches every tensor taken out of it (one eager call, such as an
                # attention kernel's output and logsumexp): checkpoint hands them to the
                # recomputation and does not run the op again.
                continue
            t = tuple_of(problem, v)
            if t is not None and t not in recomputed:
                continue  # taken out of a tuple op that is not run again (outside the range)
            recomputed.append(v)
        runs.append(BlockRun(name, reading[0], stop, tuple(recomputed),
                             tuple(sorted(cached & members)), tuple(inputs), reading[-1]))
    return runs


def always_cached(problem: Problem, blocks: EagerBlocks) -> frozenset[int]:
    """The cacheable ops that may not be recomputed: routing decisions read from data (top-k's
    values and indices, `Reason.DATA`), which every policy caches whatever the plan
    (`remat.fx_passes.eager.block_policy.BlockPolicy.keep`). Checkpoint hands them to the
    recomputation as any cached value, and eager PyTorch frees them as it frees such a value,
    not when the block's backward ends."""
    return frozenset(v for v in blocks.cacheable if recompute_blocker(problem, v) is not None)


def _pack_position(problem: Problem, blocks: EagerBlocks, b: int, members: set[int],
                   first: int) -> int:
    """The forward op whose autograd node packed what backward op `b` reads: the packer when
    the torch side knows it, else the latest forward value of the block that `b` reads (the
    output's own node packed it at the earliest)."""
    packer = blocks.packer.get(b)
    if packer is not None:
        return packer
    read = [s for s in problem.storage_inputs[b] if s in members]
    return max(read, default=first)
