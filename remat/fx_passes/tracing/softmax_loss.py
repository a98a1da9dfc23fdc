"""Log-softmax's backward read from the logits, as Inductor's step keeps it, for compiled plans.

Captured, a cross-entropy loss is ``out = _log_softmax(logits)``, ``nll_loss_forward(out, t)``
in the forward, and in the backward ``nll_loss_backward(g, out, t, ...)`` (which reads `out`
for its shape alone) and ``_log_softmax_backward_data(g', out)`` (``g' - exp(out) *
sum(g')``). So `out`, a tensor of the logits' size, is what the backward needs, and a plan
saves it or recomputes it. Inductor's step never holds it: one kernel computes log-softmax and
the loss together from the logits, and the backward makes the softmax again from the logits and
a value per row (torch.compile's min-cut partitioner saves those two; read in the generated code
of plain torch.compile of `examples/llama.py`'s Llama). On that Llama (vocab 4096, batch 4,
sequence 256) `out` is 16 MiB, and plans whose peak is at the loss read 16 MiB below their
simulation under Inductor (`benchmarks/inductor.py --models llama`).

`read_from_logits(gm)` rewrites the backward that way, in place, for a plan Inductor compiles:
``lse = logsumexp(logits)`` (a value per row, made in the
forward: ``out = logits - lse``), ``_log_softmax_backward_data`` as ``g' -
exp(logits - lse) * sum(g')``, and ``nll_loss_backward`` given the logits for the shape it
reads. `out` is then read in the forward only: the lowering counts it as fused
(`remat.fx_passes.lowering.fusion`), and the backward needs the logits, which a plan saves or
recomputes (by the head's matmul). A log-softmax that changes the dtype (``half_to_float``)
stays as it is.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import fx

from remat.fx_passes.tracing.inductor_forms import FORWARD_KEY, undetached

__all__ = ["read_from_logits"]

_aten = torch.ops.aten


def read_from_logits(gm: fx.GraphModule) -> bool:
    """Rewrite each log-softmax backward of `gm` to read the logits (module doc); whether the
    graph changed."""
    graph = gm.graph
    changed = False
    for node in list(graph.find_nodes(op="call_function",
                                      target=_aten._log_softmax_backward_data.default)):
        grad, out_read, dim, dtype = node.args[:4]
        out = undetached(out_read)
        if out.op != "call_function" or out.target is not _aten._log_softmax.default:
            continue
        logits = out.args[0]
        fake_mode = torch._guards.detect_fake_mode([out.meta.get("val")])
        if not _alike(logits, out) or not isinstance(grad, fx.Node) or fake_mode is None:
            continue
        _rewrite(graph, node, grad, logits, out, dim, dtype, fake_mode)
        _drop_unread(out_read)
        changed = True
    if changed:
        graph.lint()
        gm.recompile()
    return changed


def _alike(a: Any, b: Any) -> bool:
    va, vb = (getattr(x, "meta", {}).get("val") for x in (a, b))
    return (isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor)
            and va.shape == vb.shape and va.dtype == vb.dtype)


def _rewrite(graph: fx.Graph, node: fx.Node, grad: fx.Node, logits: fx.Node, out: fx.Node,
             dim: int, dtype: torch.dtype, fake_mode: Any) -> None:
    def call(target: Any, args: tuple, name: str) -> fx.Node:
        new = graph.create_node("call_function", target, args, name=f"{node.name}_{name}")
        values = fx.node.map_arg(args, lambda a: a.meta["val"])
        with fake_mode:
            new.meta["val"] = target(*values)
        for key in ("stack_trace", "nn_module_stack", "seq_nr"):
            if key in node.meta:
                new.meta[key] = node.meta[key]
        return new

    with graph.inserting_after(out):
        lse = call(_aten.logsumexp.default, (logits, [dim], True), "lse")
    lse.meta[FORWARD_KEY] = True  # a forward value: the lowering keeps it there
    with graph.inserting_before(node):
        shifted = call(_aten.sub.Tensor, (logits, lse), "shifted")
        softmax = call(_aten.exp.default, (shifted,), "softmax")
        total = call(_aten.sum.dim_IntList, (grad, [dim], True), "sum")
        scaled = call(_aten.mul.Tensor, (softmax, total), "scaled")
        result = call(_aten.sub.Tensor, (grad, scaled), "grad")
        if result.meta["val"].dtype != dtype:  # as the op returns the input's dtype
            result = call(torch.ops.prims.convert_element_type.default, (result, dtype),
                          "cast")
    node.replace_all_uses_with(result)
    graph.erase_node(node)
    # nll_loss_backward reads `out` for its shape alone: the logits have the same. Its total
    # weight, the forward's second output, would make `out` a value the backward needs (to
    # recompute it); without class weights it is the count of targets not ignored, made from
    # the targets.
    for user in list(out.users) + [u for d in out.users for u in d.users]:
        if user.op == "call_function" and user.target is _aten.nll_loss_backward.default \
                and undetached(user.args[1]) is out:
            args = list(user.args)
            args[1] = logits
            target, weight, ignore_index, total = args[2], args[3], args[5], args[6]
            if weight is None and isinstance(ignore_index, int):
                with graph.inserting_after(lse):
                    kept = call(_aten.ne.Scalar, (target, ignore_index), "kept")
                with graph.inserting_after(kept):
                    count = call(_aten.sum.default, (kept,), "count")
                with graph.inserting_after(count):
                    args[6] = call(torch.ops.prims.convert_element_type.default,
                                   (count, total.meta["val"].dtype), "total_weight")
                for made in (kept, count, args[6]):
                    made.meta[FORWARD_KEY] = True
            user.args = tuple(args)


def _drop_unread(node: Any) -> None:
    """The backward's detaches of `out` that nothing reads any more."""
    while isinstance(node, fx.Node) and not node.users and node.op == "call_function" \
            and node.target in (_aten.detach.default, _aten.alias.default):
        parent = node.args[0]
        node.graph.erase_node(node)
        node = parent
