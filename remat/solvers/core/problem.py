"""The training step as the solver sees it: ops in execution order, with sizes and costs.

This module is the contract between the torch side (`remat.fx_passes.lowering.lower` builds a
Problem from a captured graph) and every strategy, the simulator and the rewrite. It never imports
torch.

Conventions (the execution model of docs/execution-model.md):
- `Problem.ops` lists the ops in the order the step runs them: every forward op, then every
  backward op in the order autograd runs them. An op's `inputs` are indices of earlier ops.
- Graph inputs (parameters, batch, output gradients) are not ops: they are always available and
  belong to the static term that the planner adds, not to the activations.
- Every op produces one value, of one `Kind`:
  TENSOR owns a storage of `size` bytes; VIEW aliases the storage of its first input (its base)
  and owns nothing; TUPLE is a multi-output op whose tensors are taken out by TENSOR ops of cost
  zero (fx's getitem) that list it as their only input. A TUPLE owns nothing but allocates all
  its outputs while it runs, which `temp` records.
- `temp` bytes are live only while the op runs (workspace, outputs that are dropped at once).
- `cost` is seconds on the target device; `flops` the op's floating-point operations.
- `not_recomputable` is None for an op that may run again in the backward, else the reason.
- `is_output` marks values that live to the end of the step: the model's outputs and the
  parameter gradients. `forward_output` marks forward values that live to the end of the
  forward (what the forward returns besides its outputs and saved values).
"""
from __future__ import annotations

import bisect
import enum
import math
from dataclasses import dataclass, field
from functools import cached_property
from typing import Iterable, Sequence


class Phase(str, enum.Enum):
    FORWARD = "forward"
    BACKWARD = "backward"


class Kind(str, enum.Enum):
    TENSOR = "tensor"
    VIEW = "view"
    TUPLE = "tuple"


class Reason(str, enum.Enum):
    """Why an op may not be recomputed."""

    RANDOM = "random"  # fresh randomness would change the numbers
    MUTATION = "mutation"  # writes into an input or buffer
    SIDE_EFFECT = "side effect"  # prints, asserts, anything observable
    COLLECTIVE = "collective"  # communication must happen exactly once
    # A routing decision or a size read from data (top-k, sort, argmax, nonzero, unique):
    # recomputed by other kernels (fused, or on other rounding) it could come out differently
    # and send tokens elsewhere, or change shapes. Kept from the forward.
    DATA = "data-dependent"
    INHERITED = "inherited"  # takes its output out of a tuple op that may not be recomputed
    # A random draw of an eager plan made for torch.compile: the traced policy caches it (a
    # recomputation traced on the CPU would draw anew), so the plan caches it too.
    COMPILED_DRAW = "random draw under torch.compile"


@dataclass(frozen=True)
class Op:
    name: str
    phase: Phase
    inputs: tuple[int, ...] = ()
    size: int = 0
    kind: Kind = Kind.TENSOR
    temp: int = 0
    cost: float = 0.0
    flops: int = 0
    not_recomputable: Reason | None = None
    is_output: bool = False
    # Returned by the forward and dropped when it ends: the new values of buffers the step
    # mutates (BatchNorm's running statistics), which AOTAutograd copies into them.
    forward_output: bool = False
    module: str = ""
    target: str = ""  # the op's name in its framework ("aten.mm.default"), for reports


@dataclass(frozen=True)
class Problem:
    """A validated, immutable training step. Build it with `Problem(ops)`; it raises ValueError
    naming the offending op when the ops do not describe a step."""

    ops: tuple[Op, ...]
    name: str = ""
    # Free-form facts about where the problem came from (model, batch, target device).
    source: dict = field(default_factory=dict, compare=False)
    # Bytes per second over the link to host memory, each way (the link is full duplex), in
    # bytes per unit of `Op.cost` (seconds, or the objective's): how long an offloaded value's
    # transfers take (`remat.solvers.timeline.overlap` times them against the compute). None: the
    # step may not offload.
    host_bandwidth: float | None = None
    # Bytes of host memory the offloaded values may hold together (`Training.host_memory`);
    # None: as much as they need.
    host_capacity: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "ops", tuple(self.ops))
        _validate(self.ops)
        bandwidth = self.host_bandwidth
        if bandwidth is not None and not (isinstance(bandwidth, (int, float))
                                          and math.isfinite(bandwidth) and bandwidth > 0):
            raise ValueError(f"host_bandwidth must be a positive number of bytes per second "
                             f"(per cost unit) or None, not {bandwidth!r}")
        capacity = self.host_capacity
        if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, int)
                                     or capacity < 0):
            raise ValueError(f"host_capacity must be a non-negative int of bytes or None, not "
                             f"{capacity!r}")

    def __len__(self) -> int:
        return len(self.ops)

    @cached_property
    def num_forward(self) -> int:
        return sum(1 for op in self.ops if op.phase is Phase.FORWARD)

    @property
    def forward(self) -> range:
        return range(self.num_forward)

    @property
    def backward(self) -> range:
        return range(self.num_forward, len(self.ops))

    @cached_property
    def root(self) -> tuple[int, ...]:
        """For each op, the op that owns the storage its value lives in (itself unless a view)."""
        roots: list[int] = []
        for i, op in enumerate(self.ops):
            roots.append(roots[op.inputs[0]] if op.kind is Kind.VIEW else i)
        return tuple(roots)

    @cached_property
    def users(self) -> tuple[tuple[int, ...], ...]:
        """For each op, the ops that read its value directly, in execution order."""
        users: list[list[int]] = [[] for _ in self.ops]
        for i, op in enumerate(self.ops):
            for j in dict.fromkeys(op.inputs):
                users[j].append(i)
        return tuple(tuple(u) for u in users)

    @cached_property
    def storage_inputs(self) -> tuple[tuple[int, ...], ...]:
        """For each op, the storages (root ops) it reads, views resolved, without repeats."""
        return tuple(tuple(dict.fromkeys(self.root[j] for j in op.inputs)) for op in self.ops)

    @cached_property
    def storage_readers(self) -> tuple[tuple[int, ...], ...]:
        """For each op, the ops that read its storage, directly or through a view of it.
        Cached: every schedule's evaluation needs it, and strategies evaluate many."""
        readers: list[list[int]] = [[] for _ in self.ops]
        for i, storages in enumerate(self.storage_inputs):
            for s in storages:
                readers[s].append(i)
        # A forward output is read, in effect, when the forward returns: by its last op.
        last = self.num_forward - 1
        for i, op in enumerate(self.ops):
            if op.forward_output and last not in readers[self.root[i]]:
                bisect.insort(readers[self.root[i]], last)
        return tuple(tuple(r) for r in readers)

    @cached_property
    def pinned(self) -> frozenset[int]:
        """Storages that live to the end of the step: outputs, and bases of outputs that are
        views."""
        return frozenset(self.root[i] for i, op in enumerate(self.ops) if op.is_output)

    @cached_property
    def candidates(self) -> tuple[int, ...]:
        """Forward ops whose storage the backward may need: the only values a schedule decides
        about. Views are never candidates: a view is rebuilt from its base for free."""
        # Ops outside this closure are freed after their last forward use under every schedule.
        needed = needed_storages(self, self.forward)
        return tuple(i for i in self.forward if i in needed)

    @cached_property
    def fused_recomputations(self) -> frozenset[int]:
        """Forward values whose recomputation a compiled step fuses into their readers, named in
        ``source["free_recompute"]`` (`remat.fx_passes.lowering.fusion`), that cost nothing
        here (a FLOPs cost of a pointwise op is nothing too): a recomputed copy of one serving
        one op holds no bytes, the op reading its inputs instead
        (`remat.solvers.timeline.simulate`)."""
        names = self.source.get("free_recompute") or {}
        return frozenset(i for i in self.forward
                         if self.ops[i].name in names and not self.ops[i].cost)

    @cached_property
    def total_flops(self) -> int:
        return sum(op.flops for op in self.ops)

    @cached_property
    def total_cost(self) -> float:
        return sum(op.cost for op in self.ops)

    def index(self, name: str) -> int:
        try:
            return self._by_name[name]
        except KeyError:
            raise KeyError(f"no op named {name!r} in problem {self.name!r}") from None

    @cached_property
    def _by_name(self) -> dict[str, int]:
        return {op.name: i for i, op in enumerate(self.ops)}


def needed_storages(problem: Problem, recomputed: Iterable[int]) -> set[int]:
    """Forward storages the backward reads, directly or through a recomputation of one of
    `recomputed`: what a schedule that recomputes those must save or recompute."""
    recomputed = set(recomputed)
    nf = problem.num_forward
    frontier = [s for b in problem.backward for s in problem.storage_inputs[b] if s < nf]
    needed: set[int] = set()
    while frontier:
        v = frontier.pop()
        if v in needed:
            continue
        needed.add(v)
        if v in recomputed:
            frontier.extend(problem.storage_inputs[v])
    return needed


def _validate(ops: Sequence[Op]) -> None:
    seen_backward = False
    names: set[str] = set()
    for i, op in enumerate(ops):
        where = f"op {i} ({op.name!r})"
        if op.name in names:
            raise ValueError(f"{where}: the name is used by an earlier op; names must be unique")
        names.add(op.name)
        if not isinstance(op.phase, Phase):
            raise ValueError(f"{where}: phase must be a Phase, not {op.phase!r}")
        if op.phase is Phase.BACKWARD:
            seen_backward = True
            if op.forward_output:
                raise ValueError(f"{where}: a backward op cannot be a forward output")
        elif seen_backward:
            raise ValueError(f"{where}: a forward op after a backward op; list every forward op "
                             "first, then the backward in the order autograd runs it")
        for j in op.inputs:
            if not isinstance(j, int) or j < 0:
                raise ValueError(f"{where}: input {j!r} is not an op index")
            if j >= i:
                raise ValueError(f"{where}: input {j} comes at or after the op itself; the ops must "
                                 "be in execution order (this is also how a cycle shows)")
        for what in ("size", "temp", "flops"):
            value = getattr(op, what)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{where}: {what} must be a non-negative int, not {value!r}")
        if not (isinstance(op.cost, (int, float)) and math.isfinite(op.cost) and op.cost >= 0):
            raise ValueError(f"{where}: cost must be a finite non-negative number of seconds, "
                             f"not {op.cost!r}")
        if op.kind is Kind.VIEW:
            if not op.inputs:
                raise ValueError(f"{where}: a view needs its base as its first input")
            if op.size:
                raise ValueError(f"{where}: a view owns no bytes (size {op.size}); its base does")
            if ops[op.inputs[0]].kind is Kind.TUPLE:
                raise ValueError(f"{where}: a view of a tuple op; take the tensor out first")
        if op.kind is Kind.TUPLE and op.size:
            raise ValueError(f"{where}: a tuple op owns no bytes; put its outputs in temp and "
                             "their sizes on the ops that take them out")
        for j in op.inputs:
            if ops[j].kind is Kind.TUPLE and (op.kind is not Kind.TENSOR or op.inputs != (j,)):
                raise ValueError(f"{where}: only a tensor op with that single input may read the "
                                 f"tuple op {j} ({ops[j].name!r})")
        if op.not_recomputable is not None and not isinstance(op.not_recomputable, Reason):
            raise ValueError(f"{where}: not_recomputable must be a Reason or None")


def tuple_of(problem: Problem, v: int) -> int | None:
    """The tuple op that `v` takes its tensor out of, if any."""
    op = problem.ops[v]
    if len(op.inputs) == 1 and problem.ops[op.inputs[0]].kind is Kind.TUPLE:
        return op.inputs[0]
    return None


def recompute_blocker(problem: Problem, v: int) -> Reason | None:
    """Why `v` itself may not be recomputed (its inputs aside): its own reason, an output's
    reason, or that of the tuple op it comes out of."""
    op = problem.ops[v]
    if op.not_recomputable is not None:
        return op.not_recomputable
    t = tuple_of(problem, v)
    if t is not None and problem.ops[t].not_recomputable is not None:
        return Reason.INHERITED
    return None


def ops_named(problem: Problem, names: Iterable[str]) -> frozenset[int]:
    return frozenset(problem.index(n) for n in names)
