"""Repeated blocks of a step, and the sub-problem of one block under its boundary conditions.

A block is a module whose path ends in a list index ("layers.7", `block_of`); its ops are the
forward and backward ops of that module and its children. Blocks are identical when their ops
match one for one: kind, phase, bytes, temp, FLOPs, target, flags, and inputs (inside the block
by position; outside it by phase, kind and bytes). Not costs: measured times differ from block
to block by noise; plans are costed on the whole step anyway. A plan for one block then reads as a
plan for every identical block, position by position (`Family.tile`).

`subproblem` cuts one block out of the step, with what the rest of the step imposes on it:
- values that enter the forward from outside (the block's input, the previous block's output)
  are stand-in ops held for the whole sub-step: they are held around the block either way;
- gradients that enter the backward from outside are stand-ins at the start of its backward;
- block values that other ops read (the block's output, read by the next block) are outputs,
  kept: recomputed in every block, each would need its block's input recomputed, a chain down
  to the first block, which the sub-problem cannot see;
- gradients the block hands on to earlier blocks are outputs, held to the end;
- `hold` bytes of scratch at the end of the forward, where everything the plan saves is held
  and nothing else of the block is: a sub-budget of `hold` + x bounds what one block saves by
  about x, the bytes that stack up across the blocks before the peak.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Iterable

from remat.solvers.core.problem import Op, Phase, Problem, tuple_of

# A block is a module whose path ends in a list index: "h.3", "model.layers.12", "blocks.0".
_BLOCK = re.compile(r"^(.*?\.?\d+)(?:\.|$)")


def block_of(module_path: str) -> str | None:
    """The repeated block a module belongs to ("h.3.attn.c_attn" -> "h.3"), if any."""
    match = _BLOCK.match(module_path)
    return match.group(1) if match else None


@dataclass(frozen=True)
class Family:
    """Identical blocks, in forward order; `members[k][r]` is the op at position r of block k."""

    names: tuple[str, ...]
    members: tuple[tuple[int, ...], ...]

    @property
    def representative(self) -> int:
        """The middle block: both of its neighbours are blocks like it."""
        return len(self.members) // 2

    def positions(self, k: int, ops: Iterable[int]) -> set[int]:
        """Positions in the block of `ops`, ops of block k."""
        where = {op: r for r, op in enumerate(self.members[k])}
        return {where[op] for op in ops}

    def tile(self, k: int, positions: Iterable[int]) -> set[int]:
        """The ops of block k at `positions`."""
        return {self.members[k][r] for r in positions}


def families(problem: Problem) -> list[Family]:
    """The groups of two or more identical blocks, largest first."""
    members: dict[str, list[int]] = {}
    where: list[str | None] = []
    for i, op in enumerate(problem.ops):
        # A tensor taken out of a tuple op goes with it, whatever module the graph names.
        t = tuple_of(problem, i)
        where.append(where[t] if t is not None else block_of(op.module))
        if where[i] is not None:
            members.setdefault(where[i], []).append(i)
    groups: dict[tuple, list[str]] = {}
    for name, ops in members.items():
        groups.setdefault(_signature(problem, ops), []).append(name)
    found = [Family(tuple(names), tuple(tuple(members[n]) for n in names))
             for names in groups.values() if len(names) > 1]
    return sorted(found, key=lambda f: -len(f.members) * len(f.members[0]))


def _signature(problem: Problem, ops: list[int]) -> tuple:
    where = {op: r for r, op in enumerate(ops)}

    def source(j: int) -> tuple:
        if j in where:
            return ("in", where[j])
        other = problem.ops[problem.root[j]]
        return ("out", other.phase, other.kind, other.size)

    return tuple(
        (op.phase, op.kind, op.size, op.temp, op.flops, op.target, op.not_recomputable,
         op.is_output, op.forward_output, tuple(source(j) for j in op.inputs))
        for op in (problem.ops[i] for i in ops))


@dataclass(frozen=True)
class Sub:
    """A block's sub-problem: `ops[s]` is the step's op at sub-op s, None for a stand-in."""

    problem: Problem
    ops: tuple[int | None, ...]

    def lift(self, recomputed: Iterable[int]) -> set[int]:
        """The step's ops for sub-ops (stand-ins are never recomputed)."""
        return {self.ops[s] for s in recomputed}

    def lower(self, ops: Iterable[int]) -> set[int]:
        """The sub-ops of step ops in the block."""
        where = {op: s for s, op in enumerate(self.ops) if op is not None}
        return {where[op] for op in ops if op in where}


def subproblem(problem: Problem, block: Iterable[int], hold: int = 0) -> Sub:
    """The sub-problem of the ops `block` (a block's forward and backward ops) with the
    boundary conditions of the module docstring."""
    block = sorted(block)
    inside = set(block)
    nf = problem.num_forward
    root = problem.root
    out: list[Op] = []
    origin: list[int | None] = []
    index: dict[int, int] = {}  # step op (or outside storage) -> sub-op

    def stand_in(j: int, phase: Phase, **flags) -> None:
        s = root[j]
        index[s] = len(out)
        out.append(Op(f"boundary.{problem.ops[s].name}", phase, (), problem.ops[s].size,
                      **flags))
        origin.append(None)

    def add(i: int, **changes) -> None:
        op = problem.ops[i]
        inputs = tuple(index[j] if j in inside else index[root[j]] for j in op.inputs)
        index[i] = len(out)
        out.append(replace(op, inputs=inputs, **changes))
        origin.append(i)

    forward = [i for i in block if i < nf]
    backward = [i for i in block if i >= nf]
    outside = dict.fromkeys(root[j] for i in block for j in problem.ops[i].inputs
                            if root[j] not in inside)
    for s in outside:
        if s < nf:
            stand_in(s, Phase.FORWARD, is_output=True)
    for i in forward:
        # Kept: recomputing what another block reads would recompute that block's input in
        # every block, a chain down to the first block.
        leaves = root[i] == i and any(r not in inside for r in problem.storage_readers[i])
        add(i, is_output=problem.ops[i].is_output or leaves)
    out.append(Op("boundary.hold", Phase.FORWARD, (), 0, temp=hold))
    origin.append(None)
    for s in outside:
        if s >= nf:
            stand_in(s, Phase.BACKWARD)
    for i in backward:
        handed_on = any(r not in inside for r in problem.users[i])
        add(i, is_output=problem.ops[i].is_output or handed_on)
    return Sub(Problem(tuple(out), name=f"{problem.name}.block", source={"block": block[0]}),
               tuple(origin))
