"""Random ops that the backward can run again and draw the same numbers: RNG state snapshots.

A dropout recomputed in the backward must draw the mask it drew in the forward, or the
gradients change. `torch.utils.checkpoint` does it by saving the generator's state and
restoring it around the recomputation; this pass does the same inside the joint graph, so that
the planner can weigh a random op like any other: saving its outputs (a dropout mask is a byte
per element) against saving a snapshot of the generator (5,056 bytes on a CPU, 16 bytes of host
memory on CUDA) and running it again.

`snapshot_random_ops(gm)` puts, before every random op that draws from its device's default
generator, a node ``<op>_rng_state = rng_state(device)`` that copies the generator's state,
and makes the random op read it: its target becomes ``RandomOp(op, device)``, which prints as
the op and calls it unchanged. The rewrite turns a recomputed copy into
``RandomOp(op, device, replay=True)``, which runs the op from the snapshot and then puts the
generator back where it was, so that the rest of the step, and the next step, draw exactly what
eager PyTorch draws.

Inductor cannot run these Python targets: `as_rng_state_ops` turns them into PyTorch's own
RNG-state operators, which it runs as fallback kernels on the same generator.

The snapshot is an op like the others: the lowering gives it its bytes, it is never recomputed
(it must be taken in the forward), and the schedule saves it only when it recomputes the op.
"""
from __future__ import annotations

import operator
from typing import Any, Sequence

import torch
from torch import fx

__all__ = ["RandomOp", "as_rng_state_ops", "call_draws", "draws", "generator_offsets",
           "has_side_effects", "is_random", "rng_state", "snapshot_random_ops", "state_bytes",
           "unwrapped"]

SUFFIX = "_rng_state"


def is_random(target: Any) -> bool:
    """An aten op that draws from a generator (dropout, rand, bernoulli)."""
    return (isinstance(target, torch._ops.OpOverload)
            and torch.Tag.nondeterministic_seeded in target.tags)


def draws(node: fx.Node) -> bool:
    """Whether an aten node draws random numbers: a random op, unless the argument that gives
    its probability is 0 (attention with ``dropout_p=0.0``, which is tagged random all the same)."""
    return call_draws(node.target, node.args, node.kwargs)


def call_draws(op: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
    """`draws` for a call of `op` on `args` and `kwargs` (what a checkpoint policy is asked
    about while AOTAutograd traces)."""
    if not is_random(op):
        return False
    for i, argument in enumerate(op._schema.arguments):
        if argument.name in ("dropout_p", "p"):
            value = args[i] if i < len(args) else kwargs.get(argument.name,
                                                             argument.default_value)
            return not (isinstance(value, (int, float)) and value == 0)
    return True


def generator_offsets(node: fx.Node) -> bool:
    """Whether `node` is the seed or offset a random op returns (attention with dropout on
    CUDA: ``philox_seed``, ``philox_offset``, 0-dim int64). Eager PyTorch returns them on the
    CPU and the backward kernel reads them on the host, whatever device the traced value
    names: made up on the GPU to run the backward alone, they crashed the process (a segfault
    in efficient attention's backward, H200, torch 2.11)."""
    if node.target is not operator.getitem or not isinstance(node.args[0], fx.Node):
        return False
    source = node.args[0].target
    value = node.meta.get("val")
    return ((isinstance(source, RandomOp) or is_random(source))
            and isinstance(value, torch.Tensor) and value.dim() == 0
            and value.dtype in (torch.int64, torch.uint64))


def has_side_effects(node: fx.Node) -> bool:
    """fx's impurity apart from drawing random numbers, which `draws` and the snapshots handle
    (fx counts every op tagged random as impure, attention without dropout included)."""
    try:
        return node.is_impure(impure_random=False)
    except TypeError:  # a torch whose is_impure has no such flag
        return node.is_impure() and not is_random(node.target)


def unwrapped(node: fx.Node) -> tuple[Any, tuple]:
    """The op and arguments a node runs, seen through `RandomOp` (its snapshot argument
    dropped): what FLOP formulas and readers of the ATen graph expect."""
    if isinstance(node.target, RandomOp):
        return node.target.op, node.args[1:]
    return node.target, node.args


def state_bytes(device: torch.device) -> int:
    """The bytes of a snapshot of the default generator of `device`."""
    if device.type == "cuda":
        # Philox: a seed and an offset of 8 bytes each, kept in host memory.
        return torch.cuda.get_rng_state(device).numel() if torch.cuda.is_available() else 16
    return torch.default_generator.get_state().numel()


def rng_state(device: torch.device) -> torch.Tensor:
    """A copy of the default generator's state of `device`. The copy is made by an aten op so
    that allocation trackers (remat's MemoryTracker is a dispatch mode) see the bytes it holds."""
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device).clone()
    return torch.default_generator.get_state().clone()


class RandomOp:
    """An fx target that runs random op `op` and reads a generator snapshot as first argument:
    kept alive for a recomputation in the forward (``replay=False``: the op draws as usual);
    drawn from in the backward (``replay=True``)."""

    def __init__(self, op: torch._ops.OpOverload, device: torch.device, replay: bool = False):
        self.op = op
        self.device = device  # whose default generator the op draws from
        self.replay = replay
        self.__name__ = op.__name__
        self.__qualname__ = getattr(op, "__qualname__", op.__name__)
        self.__module__ = "remat.fx_passes.tracing.rng"

    def replaying(self) -> "RandomOp":
        return RandomOp(self.op, self.device, replay=True)

    def __call__(self, state: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if not self.replay:
            return self.op(*args, **kwargs)
        device = self.device
        if device.type == "cuda":
            saved = torch.cuda.get_rng_state(device)
            torch.cuda.set_rng_state(state, device)
            try:
                return self.op(*args, **kwargs)
            finally:
                torch.cuda.set_rng_state(saved, device)
        generator = torch.default_generator
        saved = generator.get_state()
        generator.set_state(state)
        try:
            return self.op(*args, **kwargs)
        finally:
            generator.set_state(saved)

    def __str__(self) -> str:
        return str(self.op)

    def __repr__(self) -> str:
        return f"RandomOp({self.op}{', replay=True' if self.replay else ''})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RandomOp) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def _key(self) -> tuple:
        return self.op, self.device, self.replay


def _value_device(node: fx.Node) -> torch.device | None:
    value = node.meta.get("val")
    first = value[0] if isinstance(value, (tuple, list)) and value else value
    return first.device if isinstance(first, torch.Tensor) else None


def snapshot_random_ops(gm: fx.GraphModule) -> list[fx.Node]:
    """Give every random op of `gm` that draws from a default generator a snapshot of it, read
    as the op's first argument (see the module's docstring). Returns the snapshot nodes; a
    graph already done is left as it is. Ops with an explicit generator keep their target: the
    lowering marks them not recomputable."""
    graph = gm.graph
    fake_mode = torch._guards.detect_fake_mode(
        [n.meta.get("val") for n in graph.nodes if n.op == "placeholder"])
    added = []
    for node in list(graph.nodes):
        if node.op != "call_function" or not draws(node):
            continue
        device = _value_device(node)
        # In-place random ops (bernoulli_) write into their input: they stay as they are, not
        # recomputable. Functionalized joint graphs do not have them anyway.
        if device is None or device.type not in ("cpu", "cuda") \
                or node.kwargs.get("generator") is not None or node.target._schema.is_mutable:
            continue
        with graph.inserting_before(node):
            state = graph.create_node("call_function", rng_state, (device,),
                                      name=node.name + SUFFIX)
        size = state_bytes(device)
        if fake_mode is not None:
            with fake_mode:
                state.meta["val"] = torch.empty(size, dtype=torch.uint8)
        else:
            state.meta["val"] = torch.empty(size, dtype=torch.uint8, device="meta")
        for key in ("stack_trace", "nn_module_stack", "fwd_nn_module_stack"):
            if key in node.meta:
                state.meta[key] = node.meta[key]
        node.target = RandomOp(node.target, device)
        node.args = (state, *node.args)
        added.append(state)
    if added:
        gm.recompile()
    return added


def as_rng_state_ops(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of `gm` with its snapshots and replays as PyTorch's own RNG-state operators, for
    Inductor, which cannot run remat's Python targets: a random op whose snapshot the backward
    reads becomes ``run_and_save_rng_state(op, *args)`` (the generator's state and the op's
    output, taken together), a replay becomes ``run_with_rng_state(state, op, *args)``, and
    every other random op becomes the plain aten op again. Inductor runs these operators as
    fallback kernels on aten's generator, so with ``fallback_random`` on the step draws what
    eager draws. `gm` itself is left as the plan built it."""
    from remat.errors import RematError

    try:
        from torch._prims.rng_prims import run_and_save_rng_state, run_with_rng_state
    except ImportError as e:
        raise RematError(f"this torch ({torch.__version__}) has no RNG-state operators "
                         "(torch._prims.rng_prims), which Inductor needs to run a plan's random "
                         "ops; run the plan op by op (compile=False)") from e

    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    for node in list(graph.nodes):
        if not isinstance(node.target, RandomOp):
            continue
        state, *args = node.args
        op, device = node.target.op, node.target.device
        if device.type == "cuda" and device.index not in (None, torch.cuda.current_device()):
            # The operators snapshot the current device's generator, not the op's.
            raise RematError(f"random op {node.name!r} draws on {device}, not on the current "
                             f"device: call torch.cuda.set_device({device.index}) before the "
                             "planned step, or run it op by op (compile=False)")
        if node.target.replay:
            node.target, node.args = run_with_rng_state, (state, op, *args)
            continue
        if len(state.users) == 1:  # no backward replays this op
            node.target, node.args = op, tuple(args)
            graph.erase_node(state)
            continue
        with graph.inserting_before(node):
            both = graph.call_function(run_and_save_rng_state, (op, *args), dict(node.kwargs))
            taken = graph.call_function(operator.getitem, (both, 0))
            output = graph.call_function(operator.getitem, (both, 1))
        state.replace_all_uses_with(taken, delete_user_cb=lambda user: user is not node)
        node.replace_all_uses_with(output)
        graph.erase_node(node)
        graph.erase_node(state)
    graph.lint()
    return fx.GraphModule(gm, graph)
