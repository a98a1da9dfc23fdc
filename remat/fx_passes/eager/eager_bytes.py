"""The problem as eager PyTorch allocates (`eager_problem`), where it differs from the joint
graph's: no generator snapshots, a dropout that draws nothing returns its input, the CPU's
dropout noise in the input's dtype, Python numbers wrapped in tensors; the bytes the probe saw
eager make (`with_eager_bytes`); and, for a plan made for torch.compile, every random draw
cached as the traced policy caches it (`draws_cached`)."""
from __future__ import annotations

from dataclasses import replace
from typing import Collection

import torch
from torch import fx

from remat.fx_passes.eager.block_policy import BlockPolicy
from remat.fx_passes.tracing.dynamic import is_size_arithmetic
from remat.fx_passes.tracing.rng import RandomOp, draws, rng_state
from remat.solvers.core.problem import Kind, Problem, Reason, tuple_of

__all__ = ["draws_cached", "eager_problem", "kept_input", "random_draw", "with_eager_bytes"]


def draws_cached(problem: Problem, nodes: list[fx.Node]) -> Problem:
    """The problem of an eager plan made for torch.compile: each op that draws random numbers
    (dropout with p > 0; not attention with ``dropout_p=0``) cached, as the traced policy
    caches it (`remat.fx_passes.eager.traced`). Recomputed in the plan, a dropout made the
    compiled step hold its masks beyond the eager timeline: 24 to 50 % above it on the zoo's
    BART, Marian, Pegasus, mBART and Whisper."""
    ops = list(problem.ops)
    for v, node in enumerate(nodes):
        if v < problem.num_forward and tuple_of(problem, v) is None \
                and random_draw(problem, nodes, v):
            ops[v] = replace(ops[v], not_recomputable=Reason.COMPILED_DRAW)
    return problem if ops == list(problem.ops) else replace(problem, ops=tuple(ops))


def kept_input(node: fx.Node) -> bool:
    """A dropout that draws nothing (p=0, or eval): PyTorch's decomposition clones its input,
    eager PyTorch returns the input itself."""
    if node.target is not torch.ops.aten.clone.default:
        return False
    stack = node.meta.get("source_fn_stack") or [(None, None)]
    fn = stack[-1][1]
    return fn is torch.nn.functional.dropout or (
        isinstance(fn, type) and issubclass(fn, torch.nn.modules.dropout._DropoutNd))


def with_eager_bytes(problem: Problem, policies: dict[str, BlockPolicy],
                     keep: Collection[int] = ()) -> Problem:
    """The eager problem with the bytes the probe saw eager PyTorch make for a block's op
    (`BlockPolicy.eager_bytes`) where the joint graph's own storage has other bytes: eager
    can run other shapes than the capture. Transformers drops an all-ones padding mask only
    when it is not tracing (masking_utils' ``_ignore_causal_mask_sdpa``), so the capture
    broadcasts the mask over the batch in every attention ([batch, heads, q, k] where eager
    makes [1, heads, q, k]: OPT's, T5's). Views, tensors taken out of a tuple op, ops
    without bytes and the ops `keep` names (sizes read from the data, whose bound the one
    routing the probe saw must not replace) keep the graph's."""
    ops = list(problem.ops)
    for policy in policies.values():
        for j, nbytes in policy.eager_bytes:
            op = ops[j]
            if (op.kind in (Kind.VIEW, Kind.TUPLE) or problem.root[j] != j or op.size == 0
                    or tuple_of(problem, j) is not None or op.size == nbytes or j in keep):
                continue
            ops[j] = replace(op, size=nbytes)
    return problem if ops == list(problem.ops) else replace(problem, ops=tuple(ops))


def eager_problem(problem: Problem, nodes: list[fx.Node], device: str) -> Problem:
    """The problem as eager PyTorch allocates: no generator snapshots (checkpoint keeps the
    state, `EagerBlocks.state_bytes`), a dropout that draws nothing returns its input (a view);
    on the CPU a dropout's mask is its noise, in the input's dtype, its backward a product
    with it (no scratch); a Python number an op takes as a tensor is one (8 bytes) while the
    op runs; a size (a symbolic graph's arithmetic) is a Python int, read by no op."""
    index = {n: i for i, n in enumerate(nodes)}
    sizes = {v for v, node in enumerate(nodes) if is_size_arithmetic(node)}
    ops = [replace(op, inputs=tuple(i for i in op.inputs if i not in sizes))
           if sizes.intersection(op.inputs) else op for op in problem.ops]
    for v, node in enumerate(nodes):
        if node.target is rng_state:  # checkpoint keeps one state per block instead
            ops[v] = replace(ops[v], size=0)
        if kept_input(node):
            base = index.get(node.args[0]) if isinstance(node.args[0], fx.Node) else None
            ops[v] = (replace(ops[v], kind=Kind.VIEW, size=0, inputs=(base,))
                      if base is not None and ops[base].kind is not Kind.TUPLE
                      else replace(ops[v], size=0))
    for v, node in enumerate(nodes):
        if device.startswith("cuda"):
            break
        if getattr(node.target, "_overloadname", "") == "Tensor":
            # A Python number where the op takes a tensor (``x * 0.5``) is wrapped by eager
            # PyTorch in an 8-byte tensor for the op's duration (the graph keeps the number).
            numbers = sum(isinstance(a, (int, float)) for a in node.args)
            ops[v] = replace(ops[v], temp=ops[v].temp + 8 * numbers)
        if str(node.target) == "aten.native_dropout_backward.default":
            # Eager's is MulBackward0, the gradient times the saved noise; the joint graph's
            # kernel first makes a float copy of its boolean mask (its measured scratch).
            ops[v] = replace(ops[v], temp=0)
            continue
        if str(node.target) != "aten.native_dropout.default":
            continue
        items = {n.args[1]: index[n] for n in node.users if n in index}
        if 0 in items and 1 in items:
            out, mask = ops[items[0]], ops[items[1]]
            # The tuple op stands for empty_like, bernoulli_ and div_: the noise alone; the
            # output is made by the mul that its getitem stands for.
            ops[items[1]] = replace(mask, size=out.size)
            ops[v] = replace(ops[v], temp=out.size)
    return Problem(tuple(ops), name=problem.name, source=problem.source)




def random_draw(problem: Problem, nodes: list[fx.Node], v: int) -> bool:
    """Whether joint op `v`, or the tuple op it is taken out of, draws random numbers: a
    random op snapshotted for recomputation, or one that draws where no snapshot was put."""
    t = tuple_of(problem, v)
    node = nodes[v if t is None else t]
    return isinstance(node.target, RandomOp) or draws(node)
