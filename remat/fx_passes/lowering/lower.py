"""Lower a captured, profiled joint graph to the solvers' `Problem`.

API
---
``lower(captured, *, target="h100", measure=False, device=None) -> remat.solvers.Problem``
    Profiles the graph first unless `profile` already ran on it. One op per fx node that runs,
    named exactly as the node, so that a Schedule's op indices map back to the joint graph:
    ``problem.ops[i].name == node.name``. Use `op_nodes(captured, problem)` for the nodes.

Rules (the execution model of docs/execution-model.md):
- Order: the forward ops in the joint graph's order, then the backward ops in the order
  autograd traced (and runs) them, views and ops no output gradient reaches moved to just
  before their first reader (`_views_sunk`). Phase is the partitioner's: a node is forward
  when a forward output needs it (plus the getitems of forward multi-output ops, which
  AOTAutograd's partitioner also keeps in the forward); everything else that runs is
  backward.
- Placeholders (parameters, buffers, inputs, tangents) are not ops: they are static. Nodes no
  output needs are dropped (fx never runs them after partitioning).
- Kind: VIEW for an op whose value aliases another op's storage (views, in-place results,
  getitems of ``split``); an alias of a placeholder owns nothing and is a TENSOR of size 0.
  A multi-output op is a TUPLE whose ``temp`` is the bytes of all its outputs, and its getitems
  are TENSOR ops of cost 0 with the tuple as only input.
- Random ops (dropout, rand, bernoulli) are recomputable: each reads a snapshot of its
  generator, an op of its own (``<op>_rng_state``, see `remat.fx_passes.tracing.rng`) that is RANDOM,
  not recomputable, and saved only when the random op is recomputed. A random op with an
  explicit generator has no snapshot and is RANDOM itself. In-place writes, and forward ops
  that read an input the step mutates (BatchNorm running statistics, which change after the
  forward), are MUTATION; impure nodes are SIDE_EFFECT; communication ops are COLLECTIVE;
  routing decisions and sizes read from data (top-k, sort, argmax, nonzero) are DATA: kept
  from the forward, so that a recomputation by other kernels cannot route differently.
- ``is_output``: the forward's outputs (the loss) and gradients; ``forward_output``: mutated
  inputs' new values, which live to the end of the forward.
- The output gradients (the loss's 4-byte seed) are no ops: the storage of the output each
  is the gradient of counts it (`_with_seeds`).
"""
from __future__ import annotations

import logging
import operator
import types
from dataclasses import replace

from torch import fx

from remat.fx_passes.tracing.capture import Captured
from remat.fx_passes.tracing.dynamic import is_size_arithmetic
from remat.fx_passes.tracing.inductor_forms import FORWARD_KEY
from remat.fx_passes.lowering.fusion import (free_recomputations, fused_ops,
                                             with_free_recomputations, with_fused)
from remat.fx_passes.measuring.profile_pass import profile as run_profile
from remat.fx_passes.tracing.names import target_name
from remat.fx_passes.tracing.rng import RandomOp, draws, has_side_effects, rng_state, state_bytes
from remat.fx_passes.measuring.storage import remat_meta, storage_bytes
from remat.solvers.core.problem import Kind, Op, Phase, Problem, Reason

log = logging.getLogger(__name__)

__all__ = ["lower", "op_nodes", "phases", "parameter_gradients"]

_COLLECTIVE_NAMESPACES = {"_c10d_functional", "c10d", "c10d_functional", "_dtensor"}


def _ancestors(roots: list[fx.Node]) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    stack = list(roots)
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        stack.extend(node.all_input_nodes)
    return seen


def _hoisted(node: fx.Node) -> bool:
    """A node of the backward's that the forward runs when what it reads is forward."""
    return is_size_arithmetic(node) or FORWARD_KEY in node.meta


def phases(captured: Captured) -> dict[fx.Node, Phase]:
    """The phase of every node that runs (placeholders and the output node excluded)."""
    graph = captured.graph
    forward = _ancestors(captured.forward_outputs)
    live = _ancestors([v for v in captured.output_values if isinstance(v, fx.Node)])
    result: dict[fx.Node, Phase] = {}
    for node in graph.nodes:
        if node.op != "call_function" or node not in live:
            continue
        parent = node.args[0] if node.target is operator.getitem else None
        if node in forward or (isinstance(parent, fx.Node) and parent in forward):
            result[node] = Phase.FORWARD
        elif _hoisted(node) and all(result.get(a) is Phase.FORWARD or a.op == "placeholder"
                                    for a in node.all_input_nodes):
            # A size of a forward tensor that the backward reads: taken in the forward and
            # handed over as a number (AOTAutograd's saved symints), not by keeping the tensor.
            # Likewise a compiled plan's ReLU masks (inductor_forms.FORWARD_KEY): a bool per
            # element the backward can save instead of the ReLU's output.
            result[node] = Phase.FORWARD
        else:
            result[node] = Phase.BACKWARD
    return result


def _forward_order(graph: fx.Graph, phase: dict[fx.Node, Phase],
                   forward: set[fx.Node]) -> list[fx.Node]:
    """The forward ops in graph order, the sizes that only the backward reads (`phases`) right
    after what they read, so that they end no tensor's life later than it ends anyway."""
    moved = [n for n in graph.nodes if phase.get(n) is Phase.FORWARD and n not in forward
             and _hoisted(n)]
    skip = set(moved)
    order = [n for n in graph.nodes if phase.get(n) is Phase.FORWARD and n not in skip]
    if not moved:
        return order
    position = {n: i for i, n in enumerate(order)}
    anchor: dict[fx.Node, int] = {}
    after: dict[int, list[fx.Node]] = {}
    for node in moved:  # graph order: a size computed from another comes after it
        anchor[node] = max((position[a] if a in position else anchor.get(a, -1)
                            for a in node.all_input_nodes), default=-1)
        after.setdefault(anchor[node], []).append(node)
    result = list(after.get(-1, []))
    for i, node in enumerate(order):
        result += [node, *after.get(i, [])]
    return result


def _reason(node: fx.Node, mutated: set[str], phase: Phase) -> Reason | None:
    target = node.target
    meta = remat_meta(node)
    namespace = getattr(target, "namespace", "")
    if namespace in _COLLECTIVE_NAMESPACES:
        return Reason.COLLECTIVE
    # A snapshot of the generator must be taken where the random op first draws; the random op
    # itself then replays (rng.py). Random ops that draw from elsewhere cannot.
    if target is rng_state or draws(node):
        return Reason.RANDOM
    if _decides(target):
        return Reason.DATA
    if meta.get("writes") or (getattr(target, "_schema", None) is not None
                              and target._schema.is_mutable):
        return Reason.MUTATION
    if phase is Phase.FORWARD and any(n.op == "placeholder" and n.name in mutated
                                      for n in node.all_input_nodes):
        return Reason.MUTATION
    if target is not operator.getitem and has_side_effects(node):
        return Reason.SIDE_EFFECT
    return None


# Ops whose output is a decision read from the data: which elements (indices of the top k,
# of the maximum, of the nonzero entries) or how many (unique, bincount's length).
_DECISIONS = {"topk", "sort", "argsort", "argmax", "argmin", "kthvalue", "mode", "nonzero",
              "nonzero_static", "unique", "_unique", "_unique2", "unique_dim",
              "unique_consecutive", "bincount", "masked_select", "_local_scalar_dense",
              "searchsorted", "bucketize"}
_DECISIONS_WITH_DIM = {"max", "min", "median", "nanmedian"}  # max.dim: values and indices


def _decides(target) -> bool:
    packet = getattr(getattr(target, "overloadpacket", None), "__name__", None)
    if packet in _DECISIONS:
        return True
    return packet in _DECISIONS_WITH_DIM and "dim" in getattr(target, "_overloadname", "")


def _views_sunk(backward: list[fx.Node], tangents: set[str] = frozenset()) -> list[fx.Node]:
    """The backward with every view, and every op no output gradient reaches, moved to just
    before its first reader.

    AOTAutograd's joint graph opens the backward with the `detach` of every saved activation.
    A view costs nothing, but read there it makes its base a value the backward needs from its
    very first op: every recomputation would then have to run before the backward starts, and
    none could lower the peak. Moved next to its reader (what PyTorch's own partitioner does
    when it reorders the backward), a view asks for its base only when the base is used.
    The same holds for an op computed from forward values alone (Mixtral's router clones its
    top-k weights for their backward): eager autograd runs it inside the node that needs it,
    and the joint graph's place for it, the backward's first op, made the eager planner
    recompute both of Mixtral's blocks before the loss's gradient."""
    reached: set[fx.Node] = set()
    for n in backward:
        if any(a in reached or (a.op == "placeholder" and a.name in tangents)
               for a in n.all_input_nodes):
            reached.add(n)
    views = {n for n in backward if remat_meta(n).get("alias_of") is not None
             or (tangents and n not in reached)}
    placed: set[fx.Node] = set()
    order: list[fx.Node] = []

    def place(node: fx.Node) -> None:
        for arg in node.all_input_nodes:
            if arg in views and arg not in placed:
                placed.add(arg)
                place(arg)
        order.append(node)

    for node in backward:
        if node not in views:
            place(node)
    order.extend(n for n in backward if n in views and n not in placed)
    return order


def _gradient_sources(captured: Captured, phase: dict[fx.Node, Phase]) -> set[str]:
    """The placeholders the backward's gradients start from: the output gradients (tangents),
    and an input that only backward ops read (a pipeline stage's received gradient, which its
    `Seed` hands to the stage's output: there the loss's tangent reaches no op)."""
    only_backward = {p.name for p in captured.placeholders
                     if any(phase.get(u) is Phase.BACKWARD for u in p.users)
                     and not any(phase.get(u) is Phase.FORWARD for u in p.users)}
    return set(captured.tangents) | only_backward


def lower(captured: Captured, *, target="h100", measure: bool = False,
          device=None) -> Problem:
    gm = captured.graph_module
    if "remat_profile" not in gm.meta:
        run_profile(captured, target=target, measure=measure, device=device)
    prof = gm.meta["remat_profile"]
    phase = phases(captured)
    forward = _ancestors(captured.forward_outputs)
    order = (_forward_order(gm.graph, phase, forward)
             + _views_sunk([n for n in gm.graph.nodes if phase.get(n) is Phase.BACKWARD],
                           _gradient_sources(captured, phase)))
    index = {n: i for i, n in enumerate(order)}
    values = captured.output_values
    # The new values of mutated buffers lead the forward outputs; AOTAutograd copies them into
    # the buffers as the forward returns, and drops them.
    mutation = {v for v in values[:captured.num_mutation_outputs] if isinstance(v, fx.Node)}
    outputs = {v for v in values[captured.num_mutation_outputs:] if isinstance(v, fx.Node)}
    mutated = set(captured.mutated_inputs)
    ops = []
    for node in order:
        meta = remat_meta(node)
        inputs = [index[n] for n in node.all_input_nodes if n in index]
        alias = meta.get("alias_of")
        kind, size, temp = Kind.TENSOR, meta.get("bytes", 0), 0
        if alias is not None:
            size = 0
            if alias in index:  # a view of an op: its base comes first
                kind = Kind.VIEW
                inputs = [index[alias]] + [i for i in inputs if i != index[alias]]
        elif meta.get("view_tuple"):
            size = 0  # a split of a placeholder: views of static memory
        elif meta.get("tuple_bytes") or isinstance(node.meta.get("val"), (tuple, list)):
            kind, size, temp = Kind.TUPLE, 0, meta.get("tuple_bytes", 0)
        temp += meta.get("scratch", 0)  # kernel scratch, live while the op runs (scratch.py)
        if isinstance(node.target, RandomOp) and node.target.device.type != "cuda":
            # A replay holds the generator's own state while it draws from the snapshot
            # (RandomOp.__call__); on the CPU that copy is in the measured memory.
            temp += state_bytes(node.target.device)
        ops.append(Op(
            name=node.name, phase=phase[node], inputs=tuple(inputs), size=int(size),
            kind=kind, temp=int(temp), cost=float(meta.get("time", 0.0)),
            flops=int(meta.get("flops", 0)),
            not_recomputable=_reason(node, mutated, phase[node]),
            is_output=node in outputs, forward_output=node in mutation - outputs,
            module=meta.get("module", ""),
            target=_target_string(node.target),
        ))
    seeds = _with_seeds(ops, captured, index)
    names = {o.name for o in ops}  # once: per gradient it took the 70B's lowering 2 of 4 s
    source = {
        "model": captured.model_name, "batch_shapes": [list(s) for s in captured.input_shapes],
        "dtype": captured.dtype, "target": prof.target.name, "device": captured.device,
        "param_count": captured.param_count, "param_bytes": captured.param_bytes,
        "buffer_bytes": captured.buffer_bytes, "input_bytes": captured.input_bytes,
        "time_source": "measured" if prof.measured else "roofline",
        "graph_nodes": len(gm.graph.nodes),
        # The parameters' gradients: the values the state's gradients term counts.
        "param_gradients": [n for n in parameter_gradients(captured).values()
                            if n in names],
        "seeds": seeds,
    }
    if captured.inductor:  # the graph a plan applies to gets the same forms (rewrite.partition)
        source["inductor_forms"] = True
    problem = Problem(tuple(ops), name=captured.model_name, source=source)
    if captured.inductor:  # what Inductor fuses away holds no memory in its step
        problem = with_fused(problem, fused_ops(problem, order))
        problem = with_free_recomputations(problem, free_recomputations(problem, order))
    log.info("lowered %s: %d ops (%d forward)", captured.model_name, len(problem),
             problem.num_forward)
    return problem


def _with_seeds(ops: list[Op], captured: Captured, index: dict[fx.Node, int]) -> dict:
    """The output gradients (the loss's seed, which ``backward()`` makes) are placeholders, not
    ops, but they take memory: autograd holds them until the backward returns. Each is counted
    in the storage of the output it is the gradient of, which lives to the end of the step
    (from the end of the forward: the seed is made as the backward begins). Returns the bytes
    added, by op name (`Problem.source["seeds"]`: the graph's own bytes are the rest)."""
    added: dict[str, int] = {}
    values = [v for v in captured.output_values[captured.num_mutation_outputs:
                                                 captured.num_fwd_outputs]
              if isinstance(v, fx.Node) and v in index]
    for tangent in (n for n in captured.placeholders if n.name in set(captured.tangents)):
        # tangents follow the outputs they are the gradients of, in order; the others (the
        # detached logits and caches) have none
        seed = tangent.meta.get("val")
        while values and not _same_kind(values[0].meta.get("val"), seed):
            values.pop(0)
        if not values:
            break
        root = index[values.pop(0)]
        while ops[root].kind is Kind.VIEW:
            root = ops[root].inputs[0]
        ops[root] = replace(ops[root], size=ops[root].size + storage_bytes(seed))
        added[ops[root].name] = added.get(ops[root].name, 0) + storage_bytes(seed)
    return added


def _same_kind(a, b) -> bool:
    return getattr(a, "shape", None) == getattr(b, "shape", None) \
        and getattr(a, "dtype", None) == getattr(b, "dtype", None)


def parameter_gradients(captured: Captured) -> dict[str, str]:
    """Parameter placeholder name -> the name of the node that is its gradient (parameters
    that get one): the joint graph returns one gradient per primal, in placeholder order."""
    primals = [n for n in captured.placeholders if n.name not in set(captured.tangents)]
    grads = captured.output_values[captured.num_fwd_outputs:]
    return {p.name: g.name for p, g in zip(primals, grads)
            if p.name in captured.params and isinstance(g, fx.Node)}


def _target_string(target) -> str:
    # A Python function's str carries its address: name it by module and name instead.
    return target_name(target) if isinstance(target, types.FunctionType) else str(target)


def op_nodes(captured: Captured, problem: Problem) -> list[fx.Node]:
    """The joint-graph node of every op of `problem`, by name."""
    by_name = {n.name: n for n in captured.graph.nodes}
    return [by_name[op.name] for op in problem.ops]
