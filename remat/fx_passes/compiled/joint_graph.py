"""The joint graph as AOTAutograd hands it over, and whether it is the graph a problem was
lowered from: node matching, the roles of its placeholders and outputs, and the checks that a
schedule may run on it (nothing random, mutating or reading a mutated input runs twice).
Used by `remat.fx_passes.compiled.rewrite`."""
from __future__ import annotations

import logging
from typing import Any

import torch
import torch.fx as fx

from remat.errors import RematError
from remat.fx_passes.tracing.dynamic import ShapeRange, in_names, symbol_names
from remat.fx_passes.tracing.names import target_name
from remat.fx_passes.tracing.rng import draws, has_side_effects, rng_state
from remat.fx_passes.measuring.storage import remat_meta, storage_pass
from remat.solvers.core.problem import Kind, Phase, Problem
from remat.solvers.core.schedule import Schedule
from remat.solvers.timeline.evaluate import make_schedule

log = logging.getLogger(__name__)


# --- matching the joint graph to the problem -------------------------------------------------

def match_problem(joint: fx.GraphModule, problem: Problem,
                  shape_range: ShapeRange | None = None) -> list[fx.Node]:
    """The joint graph's node for every op of the problem, after checking that the two describe
    the same computation: the same nodes by name, with the same targets, inputs and bytes
    (for a graph traced for a range of shapes: the same bytes as expressions in the range's
    names, `shape_range`), forward ops independent of the output gradients."""
    if not all("bytes" in remat_meta(n) for n in joint.graph.nodes if n.op == "call_function"):
        storage_pass(joint)
    by_name = {n.name: n for n in joint.graph.nodes}
    calls = [n for n in joint.graph.nodes if n.op == "call_function"]
    where = f"the joint graph does not match problem {problem.name!r}"
    advice = ("; plan on the graph this model and these input shapes produce (capture and lower "
              "again after changing the model, its inputs' shapes or dtypes, or torch)")
    op_names = [op.name for op in problem.ops]
    expressions = problem.source.get("byte_expressions", {})
    names = symbol_names(joint, shape_range) if shape_range is not None else {}
    # Nodes that no output needs never run (the lowering drops them, fx would too); any other
    # node the problem lacks means the plan was made for another graph.
    needed = _ancestors([x for x in flat_outputs(joint) if isinstance(x, fx.Node)])
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
        # An output's size may count the gradient seed of the backward too (lower's
        # `_with_seeds`); a value Inductor fuses away counts none (lowering.fusion).
        own = (op.size - problem.source.get("seeds", {}).get(op.name, 0)
               + problem.source.get("fused", {}).get(op.name, 0))
        if isinstance(graph_bytes, torch.SymInt) and in_names(graph_bytes, names).isdigit():
            # Symbolic in type only: a constant once the shape environment's replacements are
            # made (a size a check fixed), compared as the number it is.
            graph_bytes = int(in_names(graph_bytes, names))
        if isinstance(graph_bytes, torch.SymInt):
            # Symbolic: compared as expressions, which fixes no size of the graph compiled.
            expected = expressions.get(op.name, ("?", "?"))[op.kind is Kind.TUPLE]
            got = in_names(graph_bytes, names)
            if got != expected:
                raise RematError(f"{where}: op {op.name!r} holds {expected} bytes in the problem "
                                 f"but {got} in the graph (different shapes or dtypes){advice}")
        # A tuple op's temp is its outputs plus its kernel scratch (scratch.py).
        elif graph_bytes is not None and (graph_bytes > op.temp if op.kind is Kind.TUPLE
                                          else graph_bytes != own):
            raise RematError(f"{where}: op {op.name!r} holds {op.size or op.temp} bytes in the "
                             f"problem but {graph_bytes} in the graph (different shapes or "
                             f"dtypes){advice}")
        if op.phase is Phase.FORWARD:
            bad = [a.name for a in node.all_input_nodes
                   if placeholder_kind(a) in ("tangent", "bwd_seed", "backward_state")]
            if bad:
                raise RematError(f"{where}: forward op {op.name!r} reads the backward input "
                                 f"{bad[0]!r}")
        nodes.append(node)
    return nodes


def mutated_inputs(joint: fx.GraphModule) -> list[str]:
    """Placeholders whose data the step overwrites, from AOTAutograd's output descriptors: an
    `InputMutationAOTOutput` names the input its value is copied into. Where this torch has no
    descriptors the version counters still catch such a recomputation, as an error in the
    backward."""
    descs = output_descs(joint, len(flat_outputs(joint)))
    mutated = [d.mutated_input for d in descs if type(d).__name__ == "InputMutationAOTOutput"]
    if all(d is None for d in descs):
        log.warning("the joint graph has no output descriptors; cannot check that "
                    "recomputations do not read inputs the step mutates")
    return [n.name for n in joint.graph.nodes
            if placeholder_kind(n) == "primal" and n.meta.get("desc") in mutated]


def _storage_bytes(node: fx.Node) -> Any:
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


def check_schedule(problem: Problem, schedule: Schedule, nodes: list[fx.Node],
                    mutated_inputs: frozenset[str]) -> None:
    """The schedule must be one `make_schedule` accepts for this problem, and must not
    recompute what PyTorch says cannot run twice, whatever the problem says."""
    try:
        again = make_schedule(problem, schedule.recomputed, recompute_at=schedule.recompute_at,
                              again=schedule.again, offload_at=schedule.offload_at)
    except (ValueError, KeyError) as e:
        raise RematError(f"the schedule cannot run on problem {problem.name!r}: {e}") from e
    if again.saved != schedule.saved:
        diff = sorted(problem.ops[i].name for i in again.saved ^ schedule.saved)
        raise RematError(f"the schedule's saved set disagrees with what its recomputations need "
                         f"(differs at {diff[:5]}); build schedules with make_schedule")
    for v in sorted(schedule.recomputed | schedule.again.keys()):
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


def placeholder_kind(node: fx.Node) -> str | None:
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


def is_sym(node: fx.Node) -> bool:
    return isinstance(node.meta.get("val"), (torch.SymInt, torch.SymFloat, torch.SymBool))


def flat_outputs(joint: fx.GraphModule) -> list[Any]:
    (out,) = [n for n in joint.graph.nodes if n.op == "output"]
    return list(torch.utils._pytree.arg_tree_leaves(*out.args))


def output_descs(joint: fx.GraphModule, count: int) -> list[Any]:
    (out,) = [n for n in joint.graph.nodes if n.op == "output"]
    descs = out.meta.get("desc")
    if descs is None:
        return [None] * count
    return list(torch.utils._pytree.arg_tree_leaves(descs))


def saved_descs(tensors: list[fx.Node], symints: list[fx.Node]) -> list[Any] | None:
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
