"""Split a joint forward+backward graph into the forward and backward graphs a Schedule asks for.

The forward runs every forward op of the problem, in the problem's order, and returns the
model's outputs followed by exactly the storages the schedule saves (plus the graph inputs the
backward reads, which cost nothing: they are parameters and batch). The backward takes the
saved values and the output gradients, runs the backward ops in the problem's order, and puts
each recomputation right before the backward op that `recompute_at` names, several before the
same op in forward order: the step order of `remat.solvers.simulate.step_order`. Values die
after their last use because fx deletes each local after its last reader, and the boxed calling
convention lets the backward drop its inputs as it goes.

Views are never saved or recomputed on their own: the schedule saves or recomputes their base,
and the backward copies the view node again, lazily, just before its first reader. A view
costs no bytes, so where it is rebuilt changes nothing in the timeline; what keeps the storage
alive is the last reader of the storage, which is what the simulator counts.

The output layout follows AOTAutograd's partitioners (`_extract_fwd_bwd_modules` in
torch/_functorch/partitioners.py): forward outputs are the model's outputs, saved tensors
(those that skip the version-counter check last), then saved symbolic ints; backward inputs are
the saved symbolic ints, the saved tensors, the tangents, then seed offsets and backward state.
"""
from __future__ import annotations

import logging
import operator
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
import torch.fx as fx

from remat.errors import RematError
from remat.fx_passes.capture import prepare_joint
from remat.fx_passes.rng import RandomOp, draws, has_side_effects, rng_state
from remat.fx_passes.storage import remat_meta, storage_pass
from remat.solvers.problem import Kind, Phase, Problem
from remat.solvers.schedule import Schedule, make_schedule
from remat.solvers.simulate import StepKind, step_order

log = logging.getLogger(__name__)

__all__ = ["Partition", "partition", "partition_fn", "target_name"]

# node.meta["remat"]["role"] in the rewritten backward, so tools can tell recomputations apart.
RECOMPUTE = "recompute"
REBUILT_VIEW = "rebuilt view"


@dataclass(frozen=True)
class Partition:
    """The two graphs and what passes between them, by joint-graph node name."""

    forward: fx.GraphModule
    backward: fx.GraphModule
    saved: tuple[str, ...]  # ops of the problem the forward hands to the backward, forward order
    saved_inputs: tuple[str, ...]  # graph inputs (parameters, batch) the backward reads
    saved_symints: tuple[str, ...]
    recomputed: tuple[str, ...]  # in the order the backward runs them
    num_fwd_outputs: int


def target_name(target: Any) -> str:
    """The name of an fx node's target as `Op.target` spells it ("aten.mm.default")."""
    if isinstance(target, (torch._ops.OpOverload, RandomOp)):
        return str(target)
    if target is operator.getitem:
        return "getitem"
    if isinstance(target, str):
        return target
    module = getattr(target, "__module__", "") or ""
    name = getattr(target, "__qualname__", None) or getattr(target, "__name__", repr(target))
    return f"{module}.{name}" if module and module != "_operator" else name


def partition(joint: fx.GraphModule, problem: Problem, schedule: Schedule, *,
              num_fwd_outputs: int, mutated_inputs: Iterable[str] = ()) -> Partition:
    """The forward and backward GraphModules that run `schedule` on `joint`, the graph lowered
    to `problem`. `mutated_inputs` names the placeholders whose data the step overwrites after
    the forward (BatchNorm running statistics). Raises RematError when the graph is not the
    problem's or the schedule cannot run on it."""
    prepare_joint(joint)  # as capture did
    nodes = _match(joint, problem)
    _check_schedule(problem, schedule, nodes, frozenset(mutated_inputs))
    outputs = _flat_outputs(joint)
    fwd_outputs, bwd_outputs = outputs[:num_fwd_outputs], outputs[num_fwd_outputs:]
    placeholders = [n for n in joint.graph.nodes if n.op == "placeholder"]
    kind = {n: _placeholder_kind(n) for n in placeholders}

    backward_builder = _Backward(joint, problem, schedule, nodes)
    sources = backward_builder.sources(bwd_outputs)
    position = {n: i for i, n in enumerate(joint.graph.nodes)}
    sources.sort(key=position.__getitem__)
    symints = [n for n in sources if _is_sym(n)]
    tensors = [n for n in sources if not _is_sym(n)]
    # AOTAutograd slices the last saved tensors as the ones stashed without a version check.
    tensors.sort(key=lambda n: bool(n.meta.get("saved_tensor_with_no_vc_check", False)))

    forward = _build_forward(joint, problem, nodes, fwd_outputs, tensors, symints,
                             [n for n in placeholders if kind[n] in ("primal", "fwd_seed")])
    tail = [n for n in placeholders if kind[n] == "tangent"]
    tail += [n for n in placeholders if kind[n] == "bwd_seed"]
    tail += [n for n in placeholders if kind[n] == "backward_state"]
    backward, recomputed = backward_builder.build(symints + tensors + tail, bwd_outputs)

    op_names = {op.name for op in problem.ops}
    return Partition(
        forward=forward, backward=backward,
        saved=tuple(n.name for n in tensors if n.name in op_names),
        saved_inputs=tuple(n.name for n in tensors if n.op == "placeholder"),
        saved_symints=tuple(n.name for n in symints),
        recomputed=tuple(recomputed), num_fwd_outputs=num_fwd_outputs)


def partition_fn(problem: Problem, schedule: Schedule,
                 on_partition: Callable[[Partition], None] | None = None) -> Callable:
    """A `partition_fn` for `aot_autograd(...)` that applies `schedule`; `on_partition` is
    called with every Partition it makes (once per compilation)."""

    def apply(joint_module: fx.GraphModule, _joint_inputs: Any, *, num_fwd_outputs: int,
              **_unused: Any) -> tuple[fx.GraphModule, fx.GraphModule]:
        result = partition(joint_module, problem, schedule, num_fwd_outputs=num_fwd_outputs,
                           mutated_inputs=_mutated_inputs(joint_module))
        log.debug("partitioned %s: %d saved, %d recomputed", problem.name or "graph",
                  len(result.saved), len(result.recomputed))
        if on_partition is not None:
            on_partition(result)
        return result.forward, result.backward

    return apply


# --- matching the joint graph to the problem -------------------------------------------------

def _match(joint: fx.GraphModule, problem: Problem) -> list[fx.Node]:
    """The joint graph's node for every op of the problem, after checking that the two describe
    the same computation: the same nodes by name, with the same targets and inputs, forward ops
    independent of the output gradients."""
    if not all("bytes" in remat_meta(n) for n in joint.graph.nodes if n.op == "call_function"):
        storage_pass(joint)
    by_name = {n.name: n for n in joint.graph.nodes}
    calls = [n for n in joint.graph.nodes if n.op == "call_function"]
    where = f"the joint graph does not match problem {problem.name!r}"
    advice = ("; plan on the graph this model and these input shapes produce (capture and lower "
              "again after changing the model, its inputs' shapes or dtypes, or torch)")
    op_names = [op.name for op in problem.ops]
    # Nodes that no output needs never run (the lowering drops them, fx would too); any other
    # node the problem lacks means the plan was made for another graph.
    needed = _ancestors([x for x in _flat_outputs(joint) if isinstance(x, fx.Node)])
    extra = sorted(n.name for n in calls if n in needed and n.name not in set(op_names))
    if extra:
        raise RematError(f"{where}: graph nodes {extra[:5]} are not ops of the problem{advice}")
    nodes: list[fx.Node] = []
    for i, op in enumerate(problem.ops):
        node = by_name.get(op.name)
        if node is None or node.op != "call_function":
            raise RematError(f"{where}: op {op.name!r} is not a node of the graph{advice}")
        if op.target and op.target not in (target_name(node.target), str(node.target)):
            raise RematError(f"{where}: op {op.name!r} is {op.target!r} in the problem but "
                             f"{target_name(node.target)!r} in the graph{advice}")
        graph_inputs = {a.name for a in node.all_input_nodes if a.op == "call_function"}
        op_inputs = {problem.ops[j].name for j in op.inputs}
        if graph_inputs != op_inputs:
            raise RematError(f"{where}: op {op.name!r} reads {sorted(op_inputs)} in the problem "
                             f"but {sorted(graph_inputs)} in the graph{advice}")
        graph_bytes = _storage_bytes(node)
        # A tuple op's temp is its outputs plus its kernel scratch (scratch.py).
        if graph_bytes is not None and (graph_bytes > op.temp if op.kind is Kind.TUPLE
                                        else graph_bytes != op.size):
            raise RematError(f"{where}: op {op.name!r} holds {op.size or op.temp} bytes in the "
                             f"problem but {graph_bytes} in the graph (different shapes or "
                             f"dtypes){advice}")
        if op.phase is Phase.FORWARD:
            bad = [a.name for a in node.all_input_nodes
                   if _placeholder_kind(a) in ("tangent", "bwd_seed", "backward_state")]
            if bad:
                raise RematError(f"{where}: forward op {op.name!r} reads the backward input "
                                 f"{bad[0]!r}")
        nodes.append(node)
    return nodes


def _mutated_inputs(joint: fx.GraphModule) -> list[str]:
    """Placeholders whose data the step overwrites, from AOTAutograd's output descriptors: an
    `InputMutationAOTOutput` names the input its value is copied into. Where this torch has no
    descriptors the version counters still catch such a recomputation, as an error in the
    backward."""
    descs = _output_descs(joint, len(_flat_outputs(joint)))
    mutated = [d.mutated_input for d in descs if type(d).__name__ == "InputMutationAOTOutput"]
    if all(d is None for d in descs):
        log.warning("the joint graph has no output descriptors; cannot check that "
                    "recomputations do not read inputs the step mutates")
    return [n.name for n in joint.graph.nodes
            if _placeholder_kind(n) == "primal" and n.meta.get("desc") in mutated]


def _storage_bytes(node: fx.Node) -> int | None:
    """The bytes the lowering gives a node that owns its storage (None for aliases), by the
    storage pass's own rules (kernel quirks included), so that shapes are compared exactly."""
    meta = remat_meta(node)
    if meta.get("alias_of") is not None or meta.get("view_tuple"):
        return None
    return meta["tuple_bytes"] if isinstance(node.meta.get("val"), (tuple, list)) \
        else meta["bytes"]


def _ancestors(roots: list[fx.Node]) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    stack = list(roots)
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(n.all_input_nodes)
    return seen


def _check_schedule(problem: Problem, schedule: Schedule, nodes: list[fx.Node],
                    mutated_inputs: frozenset[str]) -> None:
    """The schedule must be one `make_schedule` accepts for this problem, and must not
    recompute what PyTorch says cannot run twice, whatever the problem says."""
    try:
        again = make_schedule(problem, schedule.recomputed, recompute_at=schedule.recompute_at)
    except (ValueError, KeyError) as e:
        raise RematError(f"the schedule cannot run on problem {problem.name!r}: {e}") from e
    if again.saved != schedule.saved:
        diff = sorted(problem.ops[i].name for i in again.saved ^ schedule.saved)
        raise RematError(f"the schedule's saved set disagrees with what its recomputations need "
                         f"(differs at {diff[:5]}); build schedules with make_schedule")
    for v in schedule.recomputed:
        node = nodes[v]
        if draws(node) or node.target is rng_state:
            raise RematError(f"the schedule recomputes random op {node.name!r} "
                             f"({target_name(node.target)}) without a snapshot of its "
                             "generator: the backward would draw fresh randomness and change "
                             "the gradients; save it instead (the lowering should have marked "
                             "it not recomputable)")
        if _is_mutating(node) or has_side_effects(node):
            raise RematError(f"the schedule recomputes {node.name!r} "
                             f"({target_name(node.target)}), which mutates or has side effects; "
                             "it must run exactly once")
        stale = [a.name for a in node.all_input_nodes if a.name in mutated_inputs]
        if stale:
            raise RematError(f"the schedule recomputes {node.name!r} "
                             f"({target_name(node.target)}), which reads {stale[0]!r}, an input "
                             "the step overwrites after the forward (such as BatchNorm running "
                             "statistics): the backward would see the new values; save it "
                             "instead (the lowering should mark it not recomputable)")


def _is_mutating(node: fx.Node) -> bool:
    target = node.target
    return isinstance(target, torch._ops.OpOverload) and target._schema.is_mutable


def _placeholder_kind(node: fx.Node) -> str | None:
    """The role of a joint-graph input, by AOTAutograd's naming (see `_is_primal`,
    `_is_tangent` in torch/_functorch/_aot_autograd/utils.py)."""
    if node.op != "placeholder":
        return None
    name = str(node.target)
    if type(node.meta.get("val")).__name__ == "BackwardState":
        return "backward_state"
    if "tangents" in name:
        return "tangent"
    if "bwd_seed" in name or "bwd_base_offset" in name:
        return "bwd_seed"
    if "fwd_seed" in name or "fwd_base_offset" in name:
        return "fwd_seed"
    return "primal"


def _is_sym(node: fx.Node) -> bool:
    return isinstance(node.meta.get("val"), (torch.SymInt, torch.SymFloat, torch.SymBool))


def _flat_outputs(joint: fx.GraphModule) -> list[Any]:
    (out,) = [n for n in joint.graph.nodes if n.op == "output"]
    return list(torch.utils._pytree.arg_tree_leaves(*out.args))


def _output_descs(joint: fx.GraphModule, count: int) -> list[Any]:
    (out,) = [n for n in joint.graph.nodes if n.op == "output"]
    descs = out.meta.get("desc")
    if descs is None:
        return [None] * count
    return list(torch.utils._pytree.arg_tree_leaves(descs))


def _saved_descs(tensors: list[fx.Node], symints: list[fx.Node]) -> list[Any] | None:
    """AOTAutograd's output descriptors for saved values, where this torch has them."""
    try:
        from torch._functorch._aot_autograd.descriptors import (
            SavedForBackwardsAOTOutput, SavedForBackwardsNoVcCheckAOTOutput)
    except ImportError:  # older torch: outputs carry no descriptors
        return None
    descs = []
    for i, n in enumerate(tensors + symints):
        no_vc = i < len(tensors) and n.meta.get("saved_tensor_with_no_vc_check", False)
        descs.append((SavedForBackwardsNoVcCheckAOTOutput if no_vc
                      else SavedForBackwardsAOTOutput)(i))
    return descs


# --- the forward -----------------------------------------------------------------------------

def _graph_of(inputs: list[fx.Node]) -> tuple[fx.Graph, dict[fx.Node, fx.Node]]:
    """A new graph whose placeholders are `inputs` (metadata kept), and the map to them."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in inputs:
        env[n] = graph.placeholder(n.name)
        env[n].meta = n.meta
    return graph, env


def _build_forward(joint: fx.GraphModule, problem: Problem, nodes: list[fx.Node],
                   fwd_outputs: list[Any], tensors: list[fx.Node], symints: list[fx.Node],
                   inputs: list[fx.Node]) -> fx.GraphModule:
    graph, env = _graph_of(inputs)
    def value(n: fx.Node) -> fx.Node:
        if n not in env and n.op == "get_attr":  # a constant of the module, free to read
            env[n] = graph.node_copy(n)
        return _lookup(env, n, "forward")

    for i in problem.forward:
        env[nodes[i]] = graph.node_copy(nodes[i], value)
    values = [value(x) if isinstance(x, fx.Node) else x
              for x in [*fwd_outputs, *tensors, *symints]]
    out = graph.output(tuple(values))
    descs = _saved_descs(tensors, symints)
    if descs is not None:
        joint_descs = _output_descs(joint, len(_flat_outputs(joint)))
        out.meta["desc"] = joint_descs[:len(fwd_outputs)] + descs
    graph.lint()
    return fx.GraphModule(joint, graph)


def _lookup(env: dict[fx.Node, fx.Node], node: fx.Node, where: str) -> fx.Node:
    try:
        return env[node]
    except KeyError:
        raise RematError(f"the {where} graph reads {node.name!r} before it is computed") from None


# --- the backward ----------------------------------------------------------------------------

class _Backward:
    """Builds the backward graph. Every forward value the backward reads comes from one place:
    a saved tensor, a graph input, a recomputation, or a view rebuilt from one of these."""

    def __init__(self, joint: fx.GraphModule, problem: Problem, schedule: Schedule,
                 nodes: list[fx.Node]):
        self.joint = joint
        self.problem = problem
        self.schedule = schedule
        self.nodes = nodes
        self.index = {n: i for i, n in enumerate(nodes)}

    def _origin(self, node: fx.Node) -> str:
        """How the backward gets a joint node's value."""
        if node.op == "get_attr":
            return "constant"
        if _placeholder_kind(node) is not None:
            return "input"
        i = self.index[node]
        if i >= self.problem.num_forward:
            return "backward"
        if i in self.schedule.saved:
            return "saved"
        if i in self.schedule.recomputed:
            return "recomputed"
        if self.problem.ops[i].kind is Kind.VIEW:
            return "view"
        return "missing"

    def sources(self, bwd_outputs: list[Any]) -> list[fx.Node]:
        """The forward values (saved ops and graph inputs) the backward graph takes in."""
        readers = [self.nodes[b] for b in self.problem.backward]
        readers += [self.nodes[v] for v in self.schedule.recomputed]
        wanted = [a for r in readers for a in r.all_input_nodes]
        wanted += [x for x in bwd_outputs if isinstance(x, fx.Node)]
        found: dict[fx.Node, None] = {}
        seen: set[fx.Node] = set()
        while wanted:
            n = wanted.pop()
            if n in seen:
                continue
            seen.add(n)
            origin = self._origin(n)
            if origin == "input":
                if _placeholder_kind(n) in ("primal", "fwd_seed"):
                    found[n] = None
            elif origin == "saved":
                found[n] = None
            elif origin == "view":
                wanted.extend(n.all_input_nodes)
            elif origin == "missing":
                raise RematError(f"the backward needs forward value {n.name!r}, which the "
                                 "schedule neither saves nor recomputes")
        return list(found)

    def build(self, inputs: list[fx.Node], bwd_outputs: list[Any]
              ) -> tuple[fx.GraphModule, list[str]]:
        graph, env = _graph_of(inputs)

        def value(n: fx.Node) -> fx.Node:
            if n in env:
                return env[n]
            if self._origin(n) == "constant":
                env[n] = graph.node_copy(n)
                return env[n]
            if self._origin(n) != "view":
                raise RematError(f"the backward reads {n.name!r} before the schedule makes it "
                                 "available")
            env[n] = graph.node_copy(n, value)
            _mark(env[n], REBUILT_VIEW)
            return env[n]

        recomputed: list[str] = []
        for i, kind in step_order(self.problem, self.schedule):
            if kind is StepKind.FORWARD:
                continue
            node = self.nodes[i]
            copy = graph.node_copy(node, value)
            if kind is StepKind.RECOMPUTE:
                if isinstance(copy.target, RandomOp):
                    copy.target = copy.target.replaying()
                _mark(copy, RECOMPUTE)
                recomputed.append(node.name)
            copy.meta["autograd_backward"] = True
            env[node] = copy
        outs = tuple(value(x) if isinstance(x, fx.Node) else x for x in bwd_outputs)
        out = graph.output(outs)
        out.meta["desc"] = _output_descs(self.joint, len(_flat_outputs(self.joint)))[-len(outs):] \
            if outs else []
        graph.lint()
        return fx.GraphModule(self.joint, graph), recomputed


def _mark(node: fx.Node, role: str) -> None:
    # node_copy copies meta shallowly: replace the dict rather than write into the joint's.
    node.meta["remat"] = {**node.meta.get("remat", {}), "role": role}
