"""The graph half of `remat.fx_passes.tracing.replicate`: find the three traced blocks' regions in the
joint graph, check that they are interchangeable, and build the full joint graph.

`replicated_fields(traced, model, path, count)` returns the fields of the full model's
`Captured`. The joint graph holds the forward trace, then the backward trace; in each, a block's
region runs from its first node to the next block's first node (in the backward, blocks run
last to first). Every argument of every node of the middle block gets a rule, checked against
the first and last blocks at the same position: a node of its own block, of the previous or the
next block, one of its parameters, a value shared by all blocks (the rotary tables), or a
constant. Copies for layers 2..N-2 follow the rules; the last traced block becomes layer N-1.
Nodes are created in the full trace's order with their base names ("mm" of "mm_12"), so that
fx numbers them as it numbered the full trace's. Anything that does not fit raises `NotUniform`
with the reason.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import fx, nn

from remat.fx_passes.tracing.capture import Captured
from remat.fx_passes.tracing.names import module_path, name_gaps, node_number, numbered
from remat.fx_passes.tracing.rng import SUFFIX, rng_state
from remat.solvers.core.problem import Phase

__all__ = ["NotUniform", "TRACED", "replicated_fields"]

TRACED = 3  # first, middle (the template), last


class NotUniform(Exception):
    """The short capture does not show three interchangeable blocks; says why."""

def _layer_of(node: fx.Node, prefix: str) -> int | None:
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack")
    if not stack:
        return None
    qualified = list(stack.values())[-1]
    path = module_path(str(qualified[0] if isinstance(qualified, tuple) else qualified))
    match = re.match(re.escape(prefix) + r"(\d+)(?:\.|$)", path)
    return int(match.group(1)) if match else None


def _regions(traced: Captured, prefix: str, period: int = 1
             ) -> tuple[list[fx.Node], list[list[fx.Node]], list[list[fx.Node]]]:
    """(the graph's nodes, the forward region of each traced block, the backward regions).
    A forward region runs from a block's first node to the next block's first node, so it holds
    whatever the step runs between them; the backward alike, in the backward's block order."""
    nodes = [n for n in traced.graph.nodes if n.op not in ("placeholder", "output")]
    # The graph holds the forward trace, then the backward trace, which starts with the first
    # node that reads an output's gradient (a forward node the backward alone reads, such as a
    # weight's transpose, still sits in the forward's block).
    tainted = {p for p in traced.placeholders if p.name in traced.tangents}
    for node in nodes:
        if any(a in tainted for a in node.all_input_nodes):
            tainted.add(node)
    split = next((i for i, n in enumerate(nodes) if n in tainted), len(nodes))
    labels = [_layer_of(n, prefix) for n in nodes]
    labels = [None if layer is None else layer // period for layer in labels]  # groups
    first: dict[tuple[Phase, int], int] = {}
    for i, layer in enumerate(labels):
        if layer is not None:
            first.setdefault((Phase.FORWARD if i < split else Phase.BACKWARD, layer), i)
    if len(first) != 2 * TRACED:
        raise NotUniform(f"found forward and backward nodes of {sorted(first)} blocks")
    fwd = [first[(Phase.FORWARD, b)] for b in range(TRACED)]
    bwd = [first[(Phase.BACKWARD, b)] for b in range(TRACED)]
    span_f, span_b = fwd[2] - fwd[1], bwd[0] - bwd[1]
    if fwd[1] - fwd[0] != span_f or bwd[1] - bwd[2] != span_b or span_f <= 0 or span_b <= 0 \
            or fwd[2] + span_f > bwd[2] or bwd[0] + span_b > len(nodes):
        raise NotUniform(f"the blocks' regions differ in length (forward starts {fwd}, "
                          f"backward starts {bwd})")
    inside = set(range(fwd[0], fwd[2] + span_f)) | set(range(bwd[2], bwd[0] + span_b))
    stray = [nodes[i].name for i, layer in enumerate(labels) if layer is not None
             and i not in inside]
    if stray:
        raise NotUniform(f"nodes of the blocks outside their regions: {stray[:3]}")
    return (nodes, [nodes[s:s + span_f] for s in fwd], [nodes[s:s + span_b] for s in bwd])


def _value_key(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return (tuple(value.shape), value.dtype, tuple(value.stride()), value.device.type)
    if isinstance(value, (tuple, list)):
        return tuple(_value_key(v) for v in value)
    return type(value).__name__


def _flat_args(node: fx.Node) -> tuple[list[Any], Any]:
    """(the leaves of the node's arguments, their nesting); pytree's own is far slower."""
    leaves: list[Any] = []
    return leaves, _flatten((node.args, node.kwargs), leaves)


def _flatten(value: Any, leaves: list[Any]) -> Any:
    if isinstance(value, (tuple, list)):
        return (type(value) is tuple, tuple(_flatten(v, leaves) for v in value))
    if isinstance(value, dict):
        return ({k: None for k in value}, tuple(_flatten(v, leaves) for v in value.values()))
    leaves.append(value)
    return None


def _unflatten(spec: Any, leaves) -> Any:
    """The arguments of `spec` (from `_flatten`) with the leaves of iterator `leaves`."""
    if spec is None:
        return next(leaves)
    kind, children = spec
    values = [_unflatten(child, leaves) for child in children]
    if isinstance(kind, dict):
        return dict(zip(kind, values))
    return tuple(values) if kind else values


def _base(name: str) -> str:
    """The name fx numbers ("mm" of "mm_12"); a snapshot is named after its random op."""
    if name.endswith(SUFFIX):
        return _base(name[:-len(SUFFIX)]) + SUFFIX
    return re.sub(r"_\d+$", "", name)


@dataclass(frozen=True)
class _Blocks:
    """Where every node of the three traced blocks sits: block -> node -> (region, position)."""

    where: dict[fx.Node, tuple[int, str, int]]  # node -> (block, "f"/"b", position)
    regions: dict[tuple[int, str], list[fx.Node]]
    params: dict[fx.Node, tuple[int, str]]  # placeholder -> (block, name within the block)

    def node(self, block: int, region: str, position: int) -> fx.Node:
        return self.regions[(block, region)][position]


def _classify(blocks: _Blocks) -> dict[tuple[fx.Node, int], tuple]:
    """How each argument of the middle block reads its world, checked against the first and
    last blocks: ("same", region, pos), ("prev", ...), ("next", ...), ("param", name),
    ("shared", node) or ("const", value)."""
    rules: dict[tuple[fx.Node, int], tuple] = {}
    for region in ("f", "b"):
        for k, mid in enumerate(blocks.regions[(1, region)]):
            first, last = blocks.node(0, region, k), blocks.node(2, region, k)
            trio = (first, mid, last)
            if len({(n.op, str(n.target)) for n in trio}) != 1 or \
                    len({_base(n.name) for n in trio}) != 1 or \
                    len({_value_key(n.meta.get("val")) for n in trio}) != 1:
                raise NotUniform(f"position {k} of the {region} regions runs "
                                  f"{[n.name for n in trio]}")
            flat = [_flat_args(n) for n in trio]
            if flat[0][1] != flat[1][1] or flat[2][1] != flat[1][1]:
                raise NotUniform(f"{mid.name} takes other arguments in other blocks")
            args = [leaves for leaves, _ in flat]
            for i, (a0, a1, a2) in enumerate(zip(*args)):
                rules[(mid, i)] = _rule(blocks, a0, a1, a2, mid.name)
    return rules


def _rule(blocks: _Blocks, a0, a1, a2, name: str) -> tuple:
    if not isinstance(a1, fx.Node):
        if isinstance(a0, fx.Node) or isinstance(a2, fx.Node) or not (a0 == a1 == a2):
            raise NotUniform(f"{name} takes constants that differ between blocks")
        return ("const", a1)
    where = {n: blocks.where.get(n) for n in (a0, a1, a2) if isinstance(n, fx.Node)}
    w1 = where[a1]
    if w1 is not None:
        block, region, pos = w1
        expect = {1: ("same", (0, 2)), 0: ("prev", (None, 1)), 2: ("next", (1, None))}[block]
        for a, want in zip((a0, a2), expect[1]):
            if want is not None and where.get(a) != (want, region, pos):
                raise NotUniform(f"{name} reads {a1.name}, which the other blocks do not "
                                  "mirror")
        return (expect[0], region, pos)
    if a1 in blocks.params and blocks.params[a1][0] == 1:
        rel = blocks.params[a1][1]
        if blocks.params.get(a0) != (0, rel) or blocks.params.get(a2) != (2, rel):
            raise NotUniform(f"{name} reads parameter {rel} of another block")
        return ("param", rel)
    if a0 is not a1 or a2 is not a1:
        raise NotUniform(f"{name} reads {a1.name} where the other blocks read other values")
    return ("shared", a1)


# -- the full graph, built in the order the full trace has it
def replicated_fields(traced: Captured, model: nn.Module, path: str, count: int,
                      period: int = 1) -> dict:
    """The fields of the `Captured` of `model` (but its sizes: `model_sizes`), whose stack
    at `path` has `count` blocks,
    built from `traced`, the capture of the model cut to three of them, or, with `period`,
    to three groups of `period` consecutive blocks (each group a block here: the first,
    the template, the last). Raises NotUniform."""
    prefix = f"{path}." if path else ""
    nodes, forward, backward = _regions(traced, prefix, period)
    count //= period
    placeholders = traced.placeholders
    by_name = {p.name: p for p in placeholders}
    params: dict[fx.Node, tuple[int, str]] = {}
    for placeholder, qualified in {**traced.params, **traced.buffers}.items():
        match = re.match(re.escape(prefix) + r"(\d+)\.(.+)$", qualified)
        if match:  # (group, name within the group: the block's place in it, with a period)
            index, rest = int(match.group(1)), match.group(2)
            params[by_name[placeholder]] = (index // period, rest if period == 1
                                            else f"{index % period}.{rest}")
    regions = {(b, r): (forward if r == "f" else backward)[b] for b in range(TRACED) for r in "fb"}
    where = {n: (b, r, p) for (b, r), region in regions.items() for p, n in enumerate(region)}
    blocks = _Blocks(where, regions, params)
    rules = _classify(blocks)
    if any(p.name in set(traced.mutated_inputs) for p in params):
        raise NotUniform("a block mutates its buffers")
    for node in nodes:
        own = where.get(node, (None,))[0]
        read = {where.get(a, (None,))[0] for a in node.all_input_nodes} - {None, own}
        if (own is None and 1 in read) or {own, *read} >= {0, 2}:
            raise NotUniform(f"{node.name} reads blocks other than its neighbours")

    last = count - 1
    layer = {0: 0, 1: 1, 2: last}
    graph = fx.Graph()
    new: dict[tuple[fx.Node, int | None], fx.Node] = {}

    def original(a: fx.Node, reader_block: int | None = None) -> fx.Node:
        if a in params:
            return param_node[(layer[params[a][0]], params[a][1])]
        w = where.get(a)
        if w is None:
            return new[(a, None)]
        if w[0] == 1 and reader_block == 2:  # the last block reads layer N-2
            return at(last - 1, w[1], w[2])
        return new[(a, layer[w[0]])]

    def at(j: int, region: str, pos: int) -> fx.Node:
        block = 0 if j == 0 else 2 if j == last else 1
        return new[(regions[(block, region)][pos], j)]

    # Placeholders: the middle block's parameters again for every missing layer, after its own.
    order: list[tuple[fx.Node, int | None]] = [
        (p, layer[params[p][0]] if p in params else None) for p in placeholders]
    middle = [p for p in placeholders if params.get(p, (None,))[0] == 1]
    if middle:
        at_end = order.index((middle[-1], 1)) + 1
        order[at_end:at_end] = [(p, j) for j in range(2, last) for p in middle]
    param_node: dict[tuple[int, str], fx.Node] = {}
    qualified: dict[str, tuple[str, bool]] = {}  # new placeholder -> (its name, a buffer?)
    renamed: dict[str, str] = {}
    number = 0
    for source, j in order:
        if source.name.startswith("tangents"):
            node = graph.placeholder(source.name)
        else:
            number += 1
            node = graph.placeholder(f"primals_{number}")
        node.meta = dict(source.meta)
        new[(source, j)] = node
        if source in params:
            param_node[(j, params[source][1])] = node
            qualified[node.name] = (_qualified(prefix, j, params[source][1], period),
                                    source.name in traced.buffers)
        else:
            renamed[source.name] = node.name
            if source.name in traced.params or source.name in traced.buffers:
                qualified[node.name] = (traced.params.get(source.name)
                                        or traced.buffers[source.name],
                                        source.name in traced.buffers)

    relabelled: dict[tuple, dict] = {}
    # Names as the full trace's: fx numbers each base in creation order, counting the nodes
    # that dead-code elimination removed after tracing (Gemma-2's mask building leaves
    # gaps), so each copy skips the gaps its source had.
    gap = dict(zip(nodes, name_gaps([n.name for n in nodes])))
    last_number: dict[str, int] = {}

    def rewritten(source: fx.Node, j: int | None) -> dict:
        meta = {k: v for k, v in source.meta.items() if k != "remat"}
        traced_block = where.get(source, (None,))[0]
        if j is not None and traced_block is not None and j != traced_block:
            for key in ("nn_module_stack", "fwd_nn_module_stack"):
                if key in meta:
                    relabel_key = (tuple(meta[key].items()), traced_block, j)
                    if relabel_key not in relabelled:
                        relabelled[relabel_key] = _relabel(meta[key], prefix, traced_block, j,
                                                           period)
                    meta[key] = relabelled[relabel_key]
        return meta

    def emit(source: fx.Node, j: int | None) -> None:
        leaves, spec = _flat_args(source)
        block = where.get(source, (None,))[0]
        if block == 1:
            leaves = [_apply(rules[(source, i)], j, at, param_node, original)
                      for i in range(len(leaves))]
        else:
            leaves = [original(a, block) if isinstance(a, fx.Node) else a for a in leaves]
        args, kwargs = _unflatten(spec, iter(leaves))
        random = source.target is rng_state
        base = _base(source.name)
        candidate = "remat_rng_pending" if random else numbered(base, last_number, gap[source])
        node = graph.create_node(source.op, source.target, tuple(args), dict(kwargs),
                                 name=candidate, type_expr=source.type)
        if not random:
            last_number[base] = node_number(node.name)[1]
        node.meta = rewritten(source, j)
        new[(source, j)] = node

    f0, b2 = nodes.index(forward[0][0]), nodes.index(backward[2][0])
    f_end, b_end = f0 + 3 * len(forward[0]), b2 + 3 * len(backward[0])
    for n in nodes[:f0]:
        emit(n, None)
    for j in range(count):
        for n in regions[(0 if j == 0 else 2 if j == last else 1, "f")]:
            emit(n, j)
    for n in nodes[f_end:b2]:
        emit(n, None)
    for j in reversed(range(count)):
        for n in regions[(0 if j == 0 else 2 if j == last else 1, "b")]:
            emit(n, j)
    for n in nodes[b_end:]:
        emit(n, None)

    outputs = traced.output_values
    fwd_out = [original(v) if isinstance(v, fx.Node) else v
               for v in outputs[:traced.num_fwd_outputs]]
    primals = [p for p in placeholders if not p.name.startswith("tangents")]
    grad_of = dict(zip(primals, outputs[traced.num_fwd_outputs:]))
    grads = []
    for source, j in order:
        if source.name.startswith("tangents"):
            continue
        grad = grad_of[source]
        if isinstance(grad, fx.Node) and source in params and params[source][0] == 1:
            w = where.get(grad)
            if w is None or w[0] != 1:
                raise NotUniform(f"the gradient of {source.name} is not made by its block")
            grad = at(j, w[1], w[2])
        elif isinstance(grad, fx.Node):
            grad = original(grad)
        grads.append(grad)
    graph.output(tuple(fwd_out + grads))
    for node in graph.find_nodes(op="call_function", target=rng_state):
        user = next(iter(node.users))
        node._rename(user.name + SUFFIX)
    gm = _graph_module(traced.graph_module, graph)

    fields_ = {f.name: getattr(traced, f.name) for f in fields(Captured)}
    fields_.update(
        graph_module=gm,
        params={n: q for n, (q, buffer) in qualified.items() if not buffer},
        buffers={n: q for n, (q, buffer) in qualified.items() if buffer},
        user_inputs=[renamed[n] for n in traced.user_inputs],
        tangents=[renamed[n] for n in traced.tangents],
        mutated_inputs=[renamed[n] for n in traced.mutated_inputs])
    return fields_


def _graph_module(root: fx.GraphModule, graph: fx.Graph) -> fx.GraphModule:
    """A GraphModule that writes its Python code only when first called: planning never calls
    it, and the code of 20,000 nodes takes a good part of a second to generate."""
    try:
        from torch.fx._lazy_graph_module import _LazyGraphModule
    except ImportError:  # a torch without it: the code is generated now
        return fx.GraphModule(root, graph)
    return _LazyGraphModule(root, graph)


def _apply(rule: tuple, j: int, at, param_node, original) -> Any:
    kind = rule[0]
    if kind == "const":
        return rule[1]
    if kind == "shared":
        return original(rule[1])
    if kind == "param":
        return param_node[(j, rule[1])]
    step = {"same": 0, "prev": -1, "next": 1}[kind]
    return at(j + step, rule[1], rule[2])


def _qualified(prefix: str, group: int, name: str, period: int) -> str:
    """The full model's name of parameter `name` of `group` (with a period, `name` begins
    with the block's place in its group)."""
    place, _, rest = name.partition(".") if period > 1 else ("0", "", name)
    return f"{prefix}{group * period + int(place)}.{rest}"


def _relabel(stack: dict, prefix: str, old: int, new: int, period: int = 1) -> dict:
    """Module paths of group `old` of the short stack as those of group `new`."""
    pattern = re.compile("^" + re.escape(prefix) + r"(\d+)(?=\.|$)")

    def moved(match: re.Match) -> str:
        index = int(match.group(1))
        return match.group(0) if index // period != old else \
            f"{prefix}{new * period + index % period}"

    result = {}
    for key, value in stack.items():
        qualified, kind = value if isinstance(value, tuple) else (value, None)
        path = module_path(str(qualified))
        if pattern.match(path):
            qualified = pattern.sub(moved, path)
        result[key] = (qualified, kind) if isinstance(value, tuple) else qualified
    return result
