"""The joint graph in the forms Inductor runs, where they change what a step must save.

A plan for Inductor (`remat.optimize(..., compile=True)`) is made on the joint graph as
captured, and Inductor's decompositions are applied only after the plan partitioned it. For
most ops that changes the kernels, not what crosses from the forward to the backward. For a
few it changes the saved bytes, and torch.compile's own partitioner, which sees the decomposed
graph, saves less for them:

- ``threshold_backward(grad, out, t)`` (ReLU's backward) is ``where(out <= t, 0, grad)``. The
  comparison reads only a forward value: computed in the forward, it saves a byte per element
  (a bool mask) where the op saves ``out`` itself (four bytes in float32).
- ``max_pool2d_with_indices`` keeps its argmax as int8 offsets inside each window
  (``_low_memory_max_pool_with_offsets``), not int64 indices: an eighth of the bytes. Its
  backward is a ``scatter_add`` of the gradient at the indices, which reads the input's shape
  only, so the input need not be saved for it.

On the U-Net of `benchmarks/inductor.py` (`tests.models.UNet`, channels 16/32/64, batch 4,
64 x 64) torch.compile at budget 1.0 saves 7.87 MiB for the backward: every ReLU's output that
a convolution's backward does not read anyway is saved as its mask, and each max-pool's
argmax as int8.

`inductor_forms(gm)` applies Inductor's own decompositions (its table, `select_decomp_table`)
to these ops, node by node, in place, and marks the new nodes that read only forward values
and hold fewer bytes than what they read (the mask) ``meta["remat_forward"]``: the lowering
makes them forward ops, right after what they read, so the solver can save them instead of
what they read. It runs where every joint graph of a compiled plan is prepared, at capture and
when the plan is applied (`remat.fx_passes.tracing.capture.prepare_joint`), so the two graphs
have the same nodes and names. An op whose decomposition this torch lacks or declines (a
max-pool window over 25, dilation) stays as it is.
"""
from __future__ import annotations

import operator
from typing import Any, Callable

import torch
from torch import fx

__all__ = ["FORWARD_KEY", "inductor_forms", "undetached"]

# Set on a node of the backward's that the lowering makes a forward op (lower.phases).
FORWARD_KEY = "remat_forward"
_aten = torch.ops.aten
_KEPT_META = ("stack_trace", "nn_module_stack", "fwd_nn_module_stack", "source_fn_stack",
              "seq_nr", "original_aten")


def _targets() -> tuple[Any, ...]:
    return (_aten.threshold_backward.default, _aten.max_pool2d_with_indices.default,
            _aten.max_pool2d_with_indices_backward.default)


def _decomposition(target: Any) -> Callable | None:
    import torch._inductor.inductor_prims  # noqa: F401  (registers the low-memory pool prims)
    import torch._inductor.lowering  # noqa: F401  (the max-pool decomposition reads it)
    from torch._inductor.decomposition import select_decomp_table

    return select_decomp_table().get(target)


def _tensor_bytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (tuple, list)):
        return sum(_tensor_bytes(v) for v in value)
    return 0


def _traced(node: fx.Node, decompose: Callable, fake_mode: Any) -> fx.GraphModule | None:
    """`decompose` applied to `node`'s arguments, traced on their fake values; None where the
    decomposition declines (returns NotImplemented)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    tensors = [a for a in node.all_input_nodes]

    def call(*values):
        env = dict(zip(tensors, values))
        args = fx.node.map_arg(node.args, env.__getitem__)
        kwargs = fx.node.map_arg(node.kwargs, env.__getitem__)
        result = decompose(*args, **kwargs)
        if result is NotImplemented:
            raise _Declined()
        return result

    values = [a.meta["val"] for a in tensors]
    try:
        with fake_mode:
            return make_fx(call, tracing_mode="real")(*values)
    except _Declined:
        return None


class _Declined(Exception):
    pass


def _splice(graph: fx.Graph, node: fx.Node, traced: fx.GraphModule) -> Any:
    """The nodes of `traced` put before `node`, named after it; returns the value (a node, or a
    tuple of them) that replaces `node`'s output."""
    env: dict[fx.Node, Any] = {}
    placeholders = iter(node.all_input_nodes)
    result: Any = None
    with graph.inserting_before(node):
        for sub in traced.graph.nodes:
            if sub.op == "placeholder":
                env[sub] = next(placeholders)
            elif sub.op == "output":
                result = fx.node.map_arg(sub.args[0], env.__getitem__)
            elif sub.op == "get_attr":
                raise _Declined()  # a constant tensor the joint graph would have to own
            else:
                # A view traced on the fake values' strides: Inductor may hand the graph
                # channels-last tensors, which a reshape serves and a view refuses.
                target = _aten.reshape.default if sub.target is _aten.view.default \
                    else sub.target
                new = graph.create_node(sub.op, target,
                                        fx.node.map_arg(sub.args, env.__getitem__),
                                        fx.node.map_arg(sub.kwargs, env.__getitem__),
                                        name=f"{node.name}_{sub.name}")
                new.meta["val"] = sub.meta.get("val")
                for key in _KEPT_META:
                    if key in node.meta:
                        new.meta[key] = node.meta[key]
                env[sub] = new
    return result


def _replace(node: fx.Node, result: Any) -> None:
    """`node`'s readers read `result` instead: a tuple op's ``getitem`` readers read the
    element they took."""
    if isinstance(result, (tuple, list)):
        for user in list(node.users):
            if user.op == "call_function" and user.target is operator.getitem:
                user.replace_all_uses_with(result[user.args[1]])
                user.graph.erase_node(user)
    else:
        node.replace_all_uses_with(result)
    node.graph.erase_node(node)


def _backward_reached(graph: fx.Graph, tangents: set[str]) -> set[fx.Node]:
    reached: set[fx.Node] = set()
    for node in graph.nodes:
        if (node.op == "placeholder" and node.name in tangents) or any(
                a in reached for a in node.all_input_nodes):
            reached.add(node)
    return reached


def _mark_forward(graph: fx.Graph, new: list[fx.Node], tangents: set[str]) -> None:
    """Mark the nodes of decomposed backward ops (`new`) that read no gradient and hold fewer bytes than what they read, and
    move each right after the last node it reads."""
    reached = _backward_reached(graph, tangents)
    added = set(new)
    # Once: moving a node after its input leaves the order of the others as it was.
    position = {n: i for i, n in enumerate(graph.nodes)}
    for node in new:
        if node not in reached:
            # AOTAutograd hands the backward a forward value through detach nodes of its own:
            # the mask reads the value itself, so that it can run where the value is made.
            node.args = fx.node.map_arg(node.args, undetached)
        inputs = node.all_input_nodes
        if not inputs or any(a in reached or (a in added and FORWARD_KEY not in a.meta)
                             for a in inputs):
            continue
        if _tensor_bytes(node.meta.get("val")) >= sum(_tensor_bytes(a.meta.get("val"))
                                                      for a in inputs):
            continue
        node.meta[FORWARD_KEY] = True
        max(inputs, key=position.__getitem__).append(node)


def undetached(node: fx.Node) -> fx.Node:
    while node.op == "call_function" and node.target in (_aten.detach.default,
                                                          _aten.alias.default):
        node = node.args[0]
    return node


def inductor_forms(gm: fx.GraphModule) -> bool:
    """Decompose `gm`'s ReLU backwards and 2-d max-pools as Inductor does (see the module's
    docstring), in place. Returns whether the graph changed. A graph already done has none of
    these ops left."""
    graph = gm.graph
    # AOTAutograd names the output gradients' placeholders so (capture.py reads them so too).
    tangents = {n.name for n in graph.find_nodes(op="placeholder")
                if n.name.startswith("tangents")}
    nodes = [n for n in graph.nodes if n.op == "call_function" and n.target in _targets()]
    if not nodes:
        return False
    changed = False
    fake_mode = torch._guards.detect_fake_mode(
        [n.meta.get("val") for n in graph.nodes if n.op == "placeholder"])
    if fake_mode is None:
        return False
    in_backward = _backward_reached(graph, tangents)
    new: list[fx.Node] = []  # the nodes of decomposed backward ops
    for node in nodes:
        decompose = _decomposition(node.target)
        if decompose is None:
            continue
        traced = _traced(node, decompose, fake_mode)
        if traced is None:
            continue
        before = set(graph.nodes)
        try:
            result = _splice(graph, node, traced)
        except _Declined:
            for added in [n for n in graph.nodes if n not in before][::-1]:
                graph.erase_node(added)
            continue
        changed = True
        if node in in_backward:
            new += [n for n in graph.nodes if n not in before]
        _replace(node, result)
    if not changed:
        return False
    _mark_forward(graph, new, tangents)
    graph.lint()
    gm.recompile()
    return True
