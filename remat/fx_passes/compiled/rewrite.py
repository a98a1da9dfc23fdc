"""Split a joint forward+backward graph into the forward and backward graphs a Schedule asks for.

The forward runs every forward op of the problem, in the problem's order, and returns the
model's outputs followed by exactly the storages the schedule saves (plus the graph inputs the
backward reads, which cost nothing: they are parameters and batch). The backward takes the
saved values and the output gradients, runs the backward ops in the problem's order, and puts
each recomputation right before the backward op that `recompute_at` names, several before the
same op in forward order: the step order of `remat.solvers.timeline.simulate.step_order`. Values die
after their last use because fx deletes each local after its last reader, and the boxed calling
convention lets the backward drop its inputs as it goes.

The richer model (`Schedule.again`, `Schedule.offload_at`): a recomputation placed before a
forward op is a copy of its node in the forward graph, and every later reader reads the copy
(the earlier one dies after its last reader); a second backward recomputation likewise. Views of
a recomputed base are rebuilt from the newest copy. An offloaded value leaves the forward as a
host copy made right after its last forward reader, and the backward copies it back to the
device where `offload_at` says: on copy streams beside the compute, with the waits where
`remat.solvers.timeline.overlap`'s timeline puts them (`offload_ops`; on the CPU the copies are
plain copies, the waits nothing, and the memory the timeline's).

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
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch.fx as fx

from remat.errors import RematError
from remat.fx_passes.tracing.joint_passes import prepare_joint
from remat.fx_passes.compiled.offload_ops import GraphOffloads
from remat.fx_passes.tracing.dynamic import ShapeRange
from remat.fx_passes.compiled.joint_graph import (check_schedule, flat_outputs, is_sym,
                                                  match_problem, mutated_inputs, output_descs,
                                                  placeholder_kind, saved_descs)
from remat.fx_passes.tracing.rng import RandomOp
from remat.fx_passes.tracing.unbacked import symbolic_again
from remat.solvers.core.problem import Kind, Problem
from remat.solvers.core.schedule import Schedule
from remat.solvers.timeline.simulate import StepKind, step_order

log = logging.getLogger(__name__)

__all__ = ["Partition", "partition", "partition_fn"]

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
    recomputed: tuple[str, ...]  # in the order the backward runs them (again: repeated)
    num_fwd_outputs: int
    recomputed_in_forward: tuple[str, ...] = ()  # the forward's recomputations, in order
    offloaded: tuple[str, ...] = ()  # saved ops handed over as host copies
    host_pool: Any = None  # offload_ops.HostPool: the host buffers of the offloads


def partition(joint: fx.GraphModule, problem: Problem, schedule: Schedule, *,
              num_fwd_outputs: int, mutated_inputs: Iterable[str] = (),
              shape_range: ShapeRange | None = None) -> Partition:
    """The forward and backward GraphModules that run `schedule` on `joint`, the graph lowered
    to `problem`. `mutated_inputs` names the placeholders whose data the step overwrites after
    the forward (BatchNorm running statistics); `shape_range`, the range a symbolic graph was
    traced for. Raises RematError when the graph is not the problem's or the schedule cannot
    run on it."""
    prepare_joint(joint, inductor=problem.source.get("inductor_forms", False))  # as captured
    nodes = match_problem(joint, problem, shape_range)
    check_schedule(problem, schedule, nodes, frozenset(mutated_inputs))
    outputs = flat_outputs(joint)
    fwd_outputs, bwd_outputs = outputs[:num_fwd_outputs], outputs[num_fwd_outputs:]
    placeholders = [n for n in joint.graph.nodes if n.op == "placeholder"]
    kind = {n: placeholder_kind(n) for n in placeholders}

    offloads = GraphOffloads(problem, schedule, nodes) if schedule.offload_at else None
    backward_builder = _Backward(joint, problem, schedule, nodes, offloads)
    sources = backward_builder.sources(bwd_outputs)
    position = {n: i for i, n in enumerate(joint.graph.nodes)}
    sources.sort(key=position.__getitem__)
    symints = [n for n in sources if is_sym(n)]
    tensors = [n for n in sources if not is_sym(n)]
    # AOTAutograd slices the last saved tensors as the ones stashed without a version check.
    tensors.sort(key=lambda n: bool(n.meta.get("saved_tensor_with_no_vc_check", False)))

    forward = _build_forward(joint, problem, schedule, nodes, fwd_outputs, tensors, symints,
                             [n for n in placeholders if kind[n] in ("primal", "fwd_seed")],
                             offloads)
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
        recomputed=tuple(recomputed), num_fwd_outputs=num_fwd_outputs,
        recomputed_in_forward=tuple(_recomputed_in_forward(forward)),
        offloaded=tuple(problem.ops[v].name for v in sorted(schedule.offload_at)),
        host_pool=offloads.pool if offloads is not None else None)


def partition_fn(problem: Problem, schedule: Schedule,
                 on_partition: Callable[[Partition], None] | None = None, *,
                 shape_range: ShapeRange | None = None) -> Callable:
    """A `partition_fn` for `aot_autograd(...)` that applies `schedule`; `on_partition` is
    called with every Partition it makes (once per compilation)."""

    def apply(joint_module: fx.GraphModule, _joint_inputs: Any, *, num_fwd_outputs: int,
              **_unused: Any) -> tuple[fx.GraphModule, fx.GraphModule]:
        result = partition(joint_module, problem, schedule, num_fwd_outputs=num_fwd_outputs,
                           mutated_inputs=mutated_inputs(joint_module),
                           shape_range=shape_range)
        log.debug("partitioned %s: %d saved, %d recomputed", problem.name or "graph",
                  len(result.saved), len(result.recomputed))
        if on_partition is not None:
            on_partition(result)
        # planned at the worst case; compiled for the sizes each step has
        symbolic_again(result.forward)
        symbolic_again(result.backward)
        return result.forward, result.backward

    return apply


# --- the forward -----------------------------------------------------------------------------

def _graph_of(inputs: list[fx.Node]) -> tuple[fx.Graph, dict[fx.Node, fx.Node]]:
    """A new graph whose placeholders are `inputs` (metadata kept), and the map to them."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in inputs:
        env[n] = graph.placeholder(n.name)
        env[n].meta = n.meta
    return graph, env


def _build_forward(joint: fx.GraphModule, problem: Problem, schedule: Schedule,
                   nodes: list[fx.Node], fwd_outputs: list[Any], tensors: list[fx.Node],
                   symints: list[fx.Node], inputs: list[fx.Node],
                   offloads: GraphOffloads | None) -> fx.GraphModule:
    graph, env = _graph_of(inputs)
    views = _views_of(problem, nodes)

    def value(n: fx.Node) -> fx.Node:
        if n not in env and (n.op == "get_attr" or n in views.rebuildable):
            # A constant of the module, free to read; or a view whose base was recomputed.
            env[n] = graph.node_copy(n, value)
            if n.op != "get_attr":
                _mark(env[n], REBUILT_VIEW)
        return _lookup(env, n, "forward")

    order = _forward_steps(problem, schedule)
    for t, (i, kind) in enumerate(order):
        if offloads is not None:
            offloads.release(graph, t)
        env[nodes[i]] = graph.node_copy(nodes[i], value)
        if kind is StepKind.RECOMPUTE:
            _recomputation(env[nodes[i]], nodes[i])
            views.forget(env, i)
        if offloads is not None:
            offloads.copy_out(graph, env, t)
    if offloads is not None:
        offloads.release(graph, len(order))  # the forward's end joins the copies
    values = [value(x) if isinstance(x, fx.Node) else x
              for x in [*fwd_outputs, *tensors, *symints]]
    out = graph.output(tuple(values))
    descs = saved_descs(tensors, symints)
    if descs is not None:
        joint_descs = output_descs(joint, len(flat_outputs(joint)))
        out.meta["desc"] = joint_descs[:len(fwd_outputs)] + descs
    graph.lint()
    return fx.GraphModule(joint, graph)


def _forward_steps(problem: Problem, schedule: Schedule) -> list[tuple[int, StepKind]]:
    """The forward part of the step order: forward ops and the recomputations placed among
    them."""
    order = step_order(problem, schedule)
    return order[:_forward_end(problem, order)]


def _forward_end(problem: Problem, order: list[tuple[int, StepKind]]) -> int:
    """Where the backward begins in `order` (step_order's)."""
    if not problem.num_forward:
        return 0
    return order.index((problem.num_forward - 1, StepKind.FORWARD)) + 1


class _Views:
    """The problem's views by base, so that a recomputation of a base makes its views stale."""

    def __init__(self, by_base: dict[int, list[fx.Node]]):
        self.by_base = by_base
        self.rebuildable = {n for ns in by_base.values() for n in ns}

    def forget(self, env: dict[fx.Node, fx.Node], base: int) -> None:
        for n in self.by_base.get(base, ()):
            env.pop(n, None)


def _views_of(problem: Problem, nodes: list[fx.Node]) -> _Views:
    """Views of forward storages, forward and backward ops alike: a read through a view made
    before a recomputation of its base must read the new copy (the simulator serves every read
    from the latest copy), so such a view is rebuilt, for free, from the new copy."""
    by_base: dict[int, list[fx.Node]] = {}
    for i, op in enumerate(problem.ops):
        if op.kind is Kind.VIEW and problem.root[i] < problem.num_forward:
            by_base.setdefault(problem.root[i], []).append(nodes[i])
    return _Views(by_base)


def _recomputation(copy: fx.Node, of: fx.Node) -> None:
    if isinstance(copy.target, RandomOp):
        copy.target = copy.target.replaying()
    _mark(copy, RECOMPUTE)
    copy.meta["remat"]["of"] = of.name


def _recomputed_in_forward(forward: fx.GraphModule) -> list[str]:
    """The joint graph's names of the ops the forward graph runs again, in order."""
    return [n.meta["remat"]["of"] for n in forward.graph.nodes
            if n.meta.get("remat", {}).get("role") == RECOMPUTE]


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
                 nodes: list[fx.Node], offloads: GraphOffloads | None = None):
        self.joint = joint
        self.problem = problem
        self.schedule = schedule
        self.nodes = nodes
        self.offloads = offloads
        self.index = {n: i for i, n in enumerate(nodes)}

    def _origin(self, node: fx.Node) -> str:
        """How the backward gets a joint node's value."""
        if node.op == "get_attr":
            return "constant"
        if placeholder_kind(node) is not None:
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
                if placeholder_kind(n) in ("primal", "fwd_seed"):
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
        views = _views_of(self.problem, self.nodes)

        def value(n: fx.Node) -> fx.Node:
            if n in env:
                return env[n]
            if self._origin(n) == "constant":
                env[n] = graph.node_copy(n)
                return env[n]
            if self._origin(n) != "view" and n not in views.rebuildable:
                raise RematError(f"the backward reads {n.name!r} before the schedule makes it "
                                 "available")
            env[n] = graph.node_copy(n, value)
            _mark(env[n], REBUILT_VIEW)
            return env[n]

        recomputed: list[str] = []
        # An offloaded value arrives as its host copy, and is copied back where the schedule
        # says; until then nothing may read it (make_schedule checked).
        host = {self.nodes[v]: env.pop(self.nodes[v]) for v in self.schedule.offload_at}
        order = step_order(self.problem, self.schedule)
        begin = _forward_end(self.problem, order)
        for t, (i, kind) in enumerate(order[begin:], start=begin):
            node = self.nodes[i]
            if kind is StepKind.RELOAD:
                env[node] = self.offloads.load(graph, i, host[node])
                continue
            if self.offloads is not None:
                self.offloads.wait(graph, t)
            copy = graph.node_copy(node, value)
            if kind is StepKind.RECOMPUTE:
                _recomputation(copy, node)
                recomputed.append(node.name)
                views.forget(env, i)
            copy.meta["autograd_backward"] = True
            env[node] = copy
        outs = tuple(value(x) if isinstance(x, fx.Node) else x for x in bwd_outputs)
        out = graph.output(outs)
        out.meta["desc"] = output_descs(self.joint, len(flat_outputs(self.joint)))[-len(outs):] \
            if outs else []
        graph.lint()
        return fx.GraphModule(self.joint, graph), recomputed


def _mark(node: fx.Node, role: str) -> None:
    # node_copy copies meta shallowly: replace the dict rather than write into the joint's.
    node.meta["remat"] = {**node.meta.get("remat", {}), "role": role}
