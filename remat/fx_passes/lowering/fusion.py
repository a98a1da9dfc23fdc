"""Values Inductor fuses away, counted at no bytes in a compiled plan's problem.

Inductor keeps a pointwise op's result out of memory where it can compute it inside the
kernels that read it: a pointwise or reduction reader inlines the expression, so the value is
never a buffer. Op by op each is a tensor the simulator holds from its op to its last reader.
On the Llama of `benchmarks/inductor.py` (8 layers, hidden 256, vocab 4096) every compiled
plan read below its simulation under Inductor, by 3 MiB where its peak is in the blocks and by
16 MiB (one logits-sized tensor: log-softmax's output, fused with the loss) where it is at the
loss, so the simulation ordered plans otherwise than the allocator did, and a budget below the
least simulated peak was refused where another plan would have stood.

`fused_ops(problem, nodes)` names the ops counted at no bytes (`with_fused`) in a problem for a
plan Inductor compiles: an op whose value
- is made by a pointwise op (tagged ``pointwise``, or a softmax or log-softmax, which Inductor
  decomposes into pointwise expressions over reductions), draws nothing, and is neither an
  output nor returned by the forward;
- is read only in its own phase, so never saved for the backward: a forward value the
  backward needs is a buffer when saved, and a plan decides that, not the lowering (such
  values keep their bytes, recomputed or not: counted, not fused, which overstates);
- is read by at most `MAX_READERS` ops, each pointwise or a reduction (a matmul, a
  convolution or attention, kernels outside Inductor's, read buffers), through views only.

`free_recomputations(problem, nodes)` names the forward values the backward may need whose
recomputation Inductor fuses into their readers: the same pointwise values, every reader of
which (at most `MAX_READERS` in each phase) inlines them, whatever the phase (ReLU's masks,
read by the where of its backward; SiLU's output, read by a product in each phase). Saved, such
a value is a buffer; recomputed, its readers compute it from its inputs, with no kernel or
memory of its own. `with_free_recomputations` gives those recomputations no cost, and the
simulator holds a recomputed copy of one at no bytes where it serves one op
(`Problem.fused_recomputations`; serving two, Inductor may compute it once for both kernels
and fuse them, which `remat.solvers.timeline.simulate` counts as a buffer).

What the rule misses is left to the reading: `remat.planner.plans.inductor_check` accepts a
compiled plan on the allocator's reading of its step, and plans again where it reads over the
budget. Inductor also realizes a value read by several kernels when inlining it into each
would repeat too much work; `MAX_READERS` keeps to the values it inlines. On the CPU it
realizes such a value too where its expression computes exp, log, sigmoid or tanh
(``should_realize_on_reuse`` in torch/_inductor/ir.py); the rule does not model that (on the
Qwen2 of `benchmarks/inductor.py` it would fuse the same 134 values).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Sequence

import torch
from torch import fx

from remat.solvers.core.problem import Kind, Problem

__all__ = ["MAX_READERS", "free_recomputations", "fused_ops", "with_free_recomputations",
           "with_fused"]

# Readers of a value Inductor inlines: Inductor realizes a value on reuse only when inlining
# it repeats more reads or operations than its thresholds allow (torch._inductor.config's
# realize_reads_threshold, 4, and realize_opcount_threshold, 30).
MAX_READERS = 2

_aten = torch.ops.aten


# Ops Inductor decomposes into pointwise expressions over reductions: their values are inlined
# into readers as a pointwise op's are. Not nll_loss_backward: its decomposition scatters into
# zeros, and Inductor on the CPU kept that a buffer (the zoo's Llama, a save-all plan: read
# 407,324 B against 382,500 simulated with it fused, 405,864 without).
_SOFTMAX_LIKE = frozenset({_aten._log_softmax.default, _aten._softmax.default})
# Ops outside the pointwise and reduction tags that Inductor lowers to loops reading their
# inputs inline.
_FUSING_READERS = frozenset({_aten.nll_loss_forward.default, _aten._log_softmax.default,
                             _aten._softmax.default, _aten._log_softmax_backward_data.default,
                             _aten._softmax_backward_data.default})


def _tagged(target: object, *tags: torch.Tag) -> bool:
    return any(tag in getattr(target, "tags", ()) for tag in tags)


def _writes(target: object) -> bool:
    """Whether the op writes into an argument (an in-place op; torch 2.11 has no ``inplace``
    tag, so read from the schema)."""
    schema = getattr(target, "_schema", None)
    return schema is not None and any(a.alias_info is not None and a.alias_info.is_write
                                      for a in schema.arguments)


def _fusible(node: fx.Node) -> bool:
    target = node.target
    if _writes(target) or _tagged(target, torch.Tag.nondeterministic_seeded):
        return False
    return _tagged(target, torch.Tag.pointwise) or target in _SOFTMAX_LIKE


def _inlines(node: fx.Node) -> bool:
    target = node.target
    if _writes(target):
        return False
    return (_tagged(target, torch.Tag.pointwise, torch.Tag.reduction)
            or target in _FUSING_READERS)


def _pointwise_value(problem: Problem, nodes: Sequence[fx.Node], i: int) -> bool:
    """Whether op `i` makes a storage of its own by a pointwise op Inductor may inline, and the
    step does not hand it out (an output, or a value the forward returns)."""
    op = problem.ops[i]
    return (op.kind is Kind.TENSOR and op.size > 0 and not op.is_output
            and not op.forward_output and problem.root[i] == i and _fusible(nodes[i]))


def fused_ops(problem: Problem, nodes: Sequence[fx.Node]) -> frozenset[int]:
    """The ops of `problem` (`nodes[i]` the fx node of op i) whose values Inductor keeps out of
    memory, by the module's rule."""
    candidates = set(problem.candidates)
    fused = set()
    for i, op in enumerate(problem.ops):
        if i in candidates or not _pointwise_value(problem, nodes, i):
            continue
        readers = problem.storage_readers[i]
        aliases = [j for j in problem.users[i] if problem.root[j] == i]
        if not readers or len(readers) > MAX_READERS:
            continue
        if any(problem.ops[j].phase is not op.phase or not _inlines(nodes[j])
               for j in readers):
            continue
        if any(_writes(nodes[j].target) for j in aliases):
            continue
        fused.add(i)
    return frozenset(fused)


def with_fused(problem: Problem, fused: frozenset[int]) -> Problem:
    """`problem` with the values of `fused` at no bytes; their bytes unfused kept in its source
    by name (``source["fused"]``), which the rewrite checks against the graph's."""
    return _zeroed(problem, fused, "size", 0, "fused")


def free_recomputations(problem: Problem, nodes: Sequence[fx.Node]) -> frozenset[int]:
    """The forward values of `problem` whose recomputation Inductor fuses into the backward
    kernels that read them: values of pointwise ops by the rule of `fused_ops`, saved or not as
    a plan decides, every reader of which (at most `MAX_READERS` in each phase) inlines them.
    Recomputed, such a value has no kernel of its own and never reaches memory: its readers
    compute it from its inputs."""
    fusible = set()
    for v in problem.candidates:
        op = problem.ops[v]
        if not _pointwise_value(problem, nodes, v):
            continue
        readers = problem.storage_readers[v]
        backward = [j for j in readers if problem.ops[j].phase is not op.phase]
        forward = len(readers) - len(backward)
        if not backward or len(backward) > MAX_READERS or forward > MAX_READERS:
            continue
        if not all(_inlines(nodes[j]) for j in readers):
            continue
        if any(_writes(nodes[j].target) for j in problem.users[v] if problem.root[j] == v):
            continue
        fusible.add(v)
    return frozenset(fusible)


def with_free_recomputations(problem: Problem, free: frozenset[int]) -> Problem:
    """`problem` with the recomputations of `free` at no cost (a recomputed copy of one is
    computed inside its readers' kernels); their measured seconds kept in its source by name
    (``source["free_recompute"]``): the forward still runs them, and the report's step time
    counts them."""
    return _zeroed(problem, free, "cost", 0.0, "free_recompute")


def _zeroed(problem: Problem, chosen: frozenset[int], field: str, zero: float,
            key: str) -> Problem:
    """`problem` with `field` of the ops `chosen` at `zero`, what it was kept in its source by
    op name under `key`."""
    if not chosen:
        return problem
    ops = tuple(replace(op, **{field: zero}) if i in chosen else op
                for i, op in enumerate(problem.ops))
    kept = {problem.ops[i].name: getattr(problem.ops[i], field) for i in sorted(chosen)}
    return replace(problem, ops=ops, source={**problem.source, key: kept})
