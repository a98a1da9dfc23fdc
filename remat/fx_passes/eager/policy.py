"""Plan per-block selective checkpointing for eager mode: which ops of each block a policy may
cache (MUST_SAVE) and which it recomputes (PREFER_RECOMPUTE), and the blocks the eager planner
solves for (`eager_blocks`; its problem's bytes: `remat.fx_passes.eager.eager_bytes`).
`remat.fx_passes.eager.apply` wraps the blocks.

The plan is made on AOTAutograd's joint graph; the policy sees the ATen ops that eager
PyTorch dispatches below autograd. The two agree op for op except where functionalization or
a decomposition differs, and this module spells those out (`expected_ops`):
- the joint graph's getitems, generator snapshots and size arithmetic are not ops in eager;
- `_unsafe_view` and `view` are one view op, `lift_fresh_copy` and `lift_fresh` one op;
- dropout on the CPU is ``empty_like, bernoulli_, div_, mul`` in eager but ``native_dropout``
  (a tuple of output and boolean mask) in the joint graph; the eager noise tensor is in the
  input's dtype, so `eager_problem` gives the mask those bytes.
Where the model has weights, `remat.fx_passes.eager.probe` records what eager PyTorch really
dispatches in each block (one forward) and matches it to the joint graph's ops. At run time ops are
matched by position within the block: the policy counts the ops it is called for, and an op
other than the expected one (or a different count) raises RematError naming the block.

What the policy never caches, whatever the plan says: views (free to recompute), and in-place
ops and the tensors they later overwrite (checkpoint refuses a cached tensor that was mutated;
the functional joint graph cannot show them, the probe's run does: `probe.probe`). A block's
random draws are cached all or none (`_cached_together`): checkpoint replays the generator from
the block's start, so skipping one draw would shift the draws of every later one
(`_draws_replayed`).
"""
from __future__ import annotations

import logging
import operator
from dataclasses import replace
from typing import Any, Sequence

import torch
from torch import fx

from remat.errors import RematError
from remat.fx_passes.tracing.capture import Captured
from remat.fx_passes.tracing.dynamic import is_size_arithmetic
from remat.fx_passes.eager.block_policy import BlockPolicy, canonical
from remat.fx_passes.eager.eager_bytes import kept_input, random_draw
from remat.fx_passes.eager.probe import Observed, aligned
from remat.fx_passes.eager.runs import joined_runs, module_path, run_name, split_runs
from remat.fx_passes.eager.unused import unused_tensors
from remat.fx_passes.lowering.lower import op_nodes
from remat.fx_passes.tracing.rng import is_random, rng_state, state_bytes
from remat.solvers.timeline.eager_blocks import EagerBlocks
from remat.solvers.core.problem import (Kind, Phase, Problem, Reason, recompute_blocker,
                                   tuple_of)

log = logging.getLogger(__name__)

__all__ = ["block_paths", "eager_blocks"]

_CPU_DROPOUT = ("aten.empty_like.default", "aten.bernoulli_.float", "aten.div_.Scalar")


def block_paths(model: torch.nn.Module, problem: Problem, names: Sequence[str] | None,
                block_of) -> list[str]:
    """The module paths to checkpoint: the children of each module named in `names` that
    holds a list of blocks (ModuleList, Sequential), or the named module itself; by default
    the repeated blocks `block_of` finds in the problem's module paths."""
    if names is None:
        found = {block_of(op.module) for op in problem.ops if op.phase is Phase.FORWARD}
        paths = sorted(p for p in found if p)
        if not paths:
            raise RematError("execution=\"eager\": the model has no repeated blocks (modules "
                             "whose path ends in a list index, like \"layers.3\"); name the "
                             "modules to checkpoint with blocks=[...]")
        return paths
    paths = []
    for name in names:
        try:
            module = model.get_submodule(name)
        except AttributeError:
            raise RematError(f"blocks=: the model has no module {name!r}") from None
        if isinstance(module, (torch.nn.ModuleList, torch.nn.Sequential)):
            paths.extend(f"{name}.{child}" for child, _ in module.named_children())
        else:
            paths.append(name)
    return paths


def _block_for(module: str, paths: Sequence[str]) -> str | None:
    matches = [p for p in paths if module == p or module.startswith(p + ".")]
    return max(matches, key=len) if matches else None


def eager_blocks(captured: Captured, problem: Problem, paths: Sequence[str],
                 observed: dict[str, Observed] | None = None, *,
                 policies: dict[str, BlockPolicy] | None = None,
                 probed: tuple[tuple, tuple] | None = None
                 ) -> tuple[EagerBlocks, dict[str, BlockPolicy]]:
    """The solver's view of the blocks (ops, owners, packers, what may be cached) and each
    block's op sequence: the `observed` one (`probe`) aligned with the joint graph where
    given, else the one derived from the joint graph; or the `policies` given (a saved
    plan's, `remat.planner.plans.plan_file`), as they are, with `probed`: what its probe found that
    the graph does not show (`EagerBlocks.unread_inputs`, `unused_tensors`, in this problem's
    numbering). A module the probe saw run several times in the step is a block per run
    (`remat.fx_passes.eager.runs`)."""
    nodes = op_nodes(captured, problem)
    paths = list(dict.fromkeys(map(module_path, paths)))  # a saved plan names each run
    ops: dict[str, list[int]] = {p: [] for p in paths}
    owner: dict[int, str] = {}
    for i, op in enumerate(problem.ops):
        block = _block_for(op.module, paths)
        if block is None:
            continue
        if op.phase is Phase.FORWARD:
            ops[block].append(i)
        else:
            owner[i] = block
    missing = [p for p, members in ops.items() if not members]
    if missing:
        raise RematError(f"execution=\"eager\": blocks {missing[:3]} run no op of the captured "
                         "step; name modules that the forward calls")
    calls: dict[str, tuple[int, ...]] = {}  # where each run of a block began in its ops
    if policies is None:
        policies = {p: expected_ops(problem, nodes, p, members, captured.device)
                    for p, members in ops.items()}
        if observed is not None:
            policies = {p: aligned(pol, observed[p].ops, observed[p].freed, observed[p].mutated,
                                   observed[p].nbytes) for p, pol in policies.items()}
            calls = {p: observed[p].calls for p in paths}
    elif observed is not None:
        raise ValueError("eager_blocks: give observed ops or policies, not both")
    else:
        policies, calls = joined_runs(policies)
    joined = dict(policies)  # each module's aligned policy over all its calls
    # A module called several times (ALBERT's shared layer) is one block per call.
    for p, starts in calls.items():
        if len(starts) > 1:
            split_runs(problem, nodes, p, starts, ops, owner, policies)
    unread: tuple[tuple[int, tuple[str, ...]], ...] = ()
    unused: tuple[tuple[int, int, int, bool], ...] = ()
    if observed is not None:
        given: dict[int, tuple[int, list[str]]] = {}
        for p in paths:
            for number, size, call in observed[p].unread:
                name = p if len(observed[p].calls) == 1 else run_name(p, call)
                given.setdefault(number, (size, []))[1].append(name)
        unread = tuple((size, tuple(names)) for size, names in given.values())
        unused = _unused(problem, nodes, captured.device, observed, paths, joined, ops)
    elif probed is not None:
        unread, unused = probed
    # Autograd's sequence number ties a backward op to the forward op whose node it runs;
    # that node packed what the op reads: its outputs after it ran, its inputs before.
    packer: dict[int, int] = {}
    for block, members in ops.items():
        tensors = {v for v in members if not is_size_arithmetic(nodes[v])}  # sizes pack nothing
        by_seq: dict[Any, int] = {}
        for v in tensors:
            seq = nodes[v].meta.get("seq_nr")
            if seq is not None:
                by_seq[seq] = max(by_seq.get(seq, v), v)
        for b, name in owner.items():
            p = by_seq.get(nodes[b].meta.get("seq_nr")) if name == block else None
            if p is not None:
                packer[b] = _last_needed(problem, b, p, tensors, set(members) - tensors)
    # A node's backward is a run of consecutive backward ops with its sequence number.
    node_end: dict[int, int] = {}
    run: list[int] = []
    for b in list(problem.backward) + [None]:
        seq = None if b is None else nodes[b].meta.get("seq_nr")
        if run and (seq is None or seq != nodes[run[0]].meta.get("seq_nr")):
            node_end.update((r, run[-1]) for r in run[:-1])
            run = []
        if seq is not None:
            run.append(b)
    policies = {p: _draws_replayed(problem, nodes, pol) for p, pol in policies.items()}
    policies = {p: replace(pol, keep=frozenset(
        k for k, (joint, ok) in enumerate(zip(pol.joint, pol.cacheable))
        if ok and any(_always_cached(problem, j) for j in joint))) for p, pol in policies.items()}
    cacheable = frozenset(j for pol in policies.values()
                          for joint, ok in zip(pol.joint, pol.cacheable) if ok for j in joint)
    position = {v: after + 0.5 for pol in policies.values() for v, after in pol.made_after}
    forward_life = {j: last for pol in policies.values() for j, last in pol.life}
    groups = tuple(group for pol in policies.values() for group in _cached_together(
        problem, nodes, pol))
    cpu = torch.device(captured.device).type == "cpu"
    # A backward op that reads a weight or an input of the step (a placeholder, no op of the
    # problem, and no size: ``s0``) unpacks what its node saved through checkpoint's hooks.
    tangents = set(captured.tangents)
    unpacks = frozenset(b for b in owner if not is_size_arithmetic(nodes[b]) and any(
        n.op == "placeholder" and n.name not in tangents
        and isinstance(n.meta.get("val"), torch.Tensor) for n in nodes[b].all_input_nodes))
    blocks = EagerBlocks(ops={p: tuple(m) for p, m in ops.items()}, owner=owner,
                         state_bytes=state_bytes(torch.device("cpu")) if cpu else 0,
                         packer=packer, cacheable=cacheable, groups=groups,
                         node_end=node_end, position=position, forward_life=forward_life,
                         python_backward=_python_backward(problem, nodes),
                         unread_inputs=unread,
                         kept_numbers=_kept_numbers(problem, nodes, captured.device),
                         unused_tensors=unused, unpacks=unpacks)
    return blocks, policies


def _cached_together(problem: Problem, nodes: list[fx.Node], policy: BlockPolicy
                     ) -> list[tuple[int, ...]]:
    """The joint ops a policy caches all or none of: the tensors of one eager op with several
    outputs (layer norm's output, mean and rstd), and the block's random draws together.
    Checkpoint replays the generator from the block's start, so a recomputed draw takes the
    numbers of the first draw the recomputation makes: cached draws followed by a recomputed
    one would give it an earlier draw's numbers (two ``rand_like`` in a block, the first
    cached: gradients 5e-3 off eager's). On CUDA dropout is ``native_dropout``, which a policy
    may cache; on the CPU its draw is an in-place ``bernoulli_``, which none does
    (`_draws_replayed`)."""
    draws_at = [k for k in _draw_positions(problem, nodes, policy) if policy.cacheable[k]]
    if len(draws_at) < 2:
        draws_at = []
    groups = [joint for k, joint in enumerate(policy.joint)
              if len(joint) > 1 and k not in draws_at]
    if draws_at:
        groups.append(tuple(j for k in draws_at for j in policy.joint[k]))
    return groups


def _draws_replayed(problem: Problem, nodes: list[fx.Node], policy: BlockPolicy) -> BlockPolicy:
    """`policy` with none of its draws cacheable where one cannot be cached (on the CPU
    dropout's in-place ``bernoulli_``): the recomputation draws that one again from the
    block's start, so no draw before it may be skipped."""
    draws_at = _draw_positions(problem, nodes, policy)
    if all(policy.cacheable[k] for k in draws_at):
        return policy
    cacheable = list(policy.cacheable)
    for k in draws_at:
        cacheable[k] = False
    return replace(policy, cacheable=tuple(cacheable))


def _draw_positions(problem: Problem, nodes: list[fx.Node], policy: BlockPolicy) -> list[int]:
    """The positions of `policy` whose eager op draws random numbers."""
    return [k for k, (name, joint) in enumerate(zip(policy.ops, policy.joint))
            if _tagged_random(name) and any(random_draw(problem, nodes, j) for j in joint)]


def _tagged_random(name: str) -> bool:
    """Whether the eager op named `name` ("aten.rand_like.default") is a random op."""
    target = torch.ops
    for part in name.split("."):
        target = getattr(target, part, None)
        if target is None:
            return False
    return is_random(target)


def _unused(problem: Problem, nodes: list[fx.Node], device: str,
            observed: dict[str, Observed], paths: Sequence[str],
            joined: dict[str, BlockPolicy], ops: dict[str, list[int]]
            ) -> tuple[tuple[int, int, int, bool], ...]:
    """`EagerBlocks.unused_tensors` of the probe's run: the blocks' calls in the order they
    ran, each a block (`ops`, a run of a module called several times)."""
    order = [(p, call) for _, p, call in sorted(
        (g, p, call) for p in paths for call, g in enumerate(observed[p].order))]
    unused = observed[paths[0]].unused if paths else None
    if unused is None or not unused.found or not order:
        return ()
    return unused_tensors(
        unused, order, joined, {p: observed[p].calls for p in paths}, ops,
        lambda p, call: p if len(observed[p].calls) == 1 else run_name(p, call),
        lambda members: expected_ops(problem, nodes, "", members, device),
        problem.num_forward)


# Ops whose autograd node saves their second operand for the first's gradient (derivatives.yaml:
# mul.Tensor's and div.Tensor's `self` formulas read `other`).
_SAVE_OTHER = ("aten.mul.Tensor", "aten.div.Tensor")


def _kept_numbers(problem: Problem, nodes: list[fx.Node], device: str
                  ) -> tuple[tuple[int, int, int], ...]:
    """`EagerBlocks.kept_numbers`: each forward ``x * 0.5`` or ``x / scale`` (a Python number as
    `other`) with an autograd node, the 8-byte tensor eager PyTorch wraps the number in, which
    the node keeps to its end (its last backward op, by autograd's sequence number). On CUDA
    the wrapped number lives in host memory.

    The node is the op's own only when its backward reads the number (``grad * 0.5``,
    ``grad / scale``). An op below autograd carries the sequence number of the node it runs
    under: DTensor's ``bias / N``, which makes a row-parallel Linear's replicated bias partial
    inside the Linear's AddmmBackward0 (whose backward reads no number), wraps its number for
    that one kernel and keeps nothing (measured: 8 bytes a row-parallel bias above the
    allocator before)."""
    if device.startswith("cuda"):
        return ()
    last: dict[Any, int] = {}
    reads: dict[Any, set] = {}  # the numbers each node's backward ops take
    for b in problem.backward:
        seq = nodes[b].meta.get("seq_nr")
        if seq is not None:
            last[seq] = max(last.get(seq, b), b)
            reads.setdefault(seq, set()).update(
                a for a in nodes[b].args if type(a) in (int, float))
    # An op without an autograd node (under no_grad: the rotary embedding's ``cos * scaling``)
    # carries the sequence number of the last node made before it: the node is the first op's.
    first: dict[Any, int] = {}
    for v in range(problem.num_forward):
        first.setdefault(nodes[v].meta.get("seq_nr"), v)
    kept = []
    for v in range(problem.num_forward):
        node = nodes[v]
        seq = node.meta.get("seq_nr")
        if str(node.target) in _SAVE_OTHER and len(node.args) == 2 and first[seq] == v \
                and isinstance(node.args[0], fx.Node) and isinstance(node.args[1], (int, float)):
            b = last.get(seq)
            if b is not None and node.args[1] in reads.get(seq, ()):
                kept.append((8, v, b))
    return tuple(kept)


def _python_backward(problem: Problem, nodes: list[fx.Node]) -> frozenset[int]:
    """Backward ops traced from a backward written in Python (a custom autograd.Function's):
    AOTAutograd tags the ops of the C++ derivative formulas ``autograd_backward``; an op of
    an autograd node without the tag ran the node's Python code. Empty where no op carries
    the tag (a torch that does not set it)."""
    backward = [b for b in problem.backward if nodes[b].meta.get("seq_nr") is not None]
    if not any(nodes[b].meta.get("autograd_backward") for b in backward):
        return frozenset()
    return frozenset(b for b in backward if not nodes[b].meta.get("autograd_backward"))


def _last_needed(problem: Problem, b: int, p: int, members: set[int], sizes=()) -> int:
    """The last forward op the recomputation must run for backward op `b`, whose autograd
    node is forward op `p`'s: what `b` reads of `p`'s outputs (`p`, or the getitem that takes
    it out), and the op before `p` for what it reads of `p`'s inputs (a node packs its inputs
    before its kernel runs, and checkpoint's early stop fires at the last pack; not `sizes`,
    the block's size arithmetic, which eager does not run)."""
    made = {p} | {g for g in problem.users[p] if g in members
                  and problem.ops[g].inputs == (p,) and problem.ops[p].kind is Kind.TUPLE}
    reads = {problem.root[s] for s in problem.ops[b].inputs if s < problem.num_forward}
    before = next(v for v in range(p - 1, -2, -1) if v not in sizes)
    return max([r if r in made else before for r in reads & members], default=before)


def expected_ops(problem: Problem, nodes: list[fx.Node], path: str, members: Sequence[int],
                 device: str) -> BlockPolicy:
    """The ops eager PyTorch dispatches for the block, derived from its joint-graph ops."""
    names: list[str] = []
    joint: list[tuple[int, ...]] = []
    cacheable: list[bool] = []
    made_after: list[tuple[int, int]] = []
    index = {n: i for i, n in enumerate(nodes)}
    for v in members:
        node, op = nodes[v], problem.ops[v]
        if node.target is operator.getitem or node.target is rng_state or kept_input(node) \
                or is_size_arithmetic(node):
            continue
        outputs = (v,)
        if op.kind is Kind.TUPLE:
            items = {n.args[1]: index[n] for n in node.users if n in index}
            outputs = tuple(items[k] for k in sorted(items))
        name = canonical(str(node.target))
        if name == "aten.native_dropout.default" and not device.startswith("cuda"):
            items = {n.args[1]: index[n] for n in node.users if n in index}
            for piece in _CPU_DROPOUT:
                names.append(piece)
                joint.append((items[1],) if 1 in items else ())
                cacheable.append(False)
            names.append("aten.mul.Tensor")
            joint.append((items[0],))
            cacheable.append(True)
            if 1 in items:
                made_after.append((items[0], items[1]))
            continue
        names.append(name)
        joint.append(outputs)
        cacheable.append(op.kind is not Kind.VIEW
                         and (recompute_blocker(problem, v) is None or _always_cached(problem, v))
                         and all(problem.ops[o].kind is not Kind.VIEW for o in outputs))
    return BlockPolicy(path, tuple(names), tuple(joint), tuple(cacheable), tuple(made_after))


def _always_cached(problem: Problem, v: int) -> bool:
    """Whether op `v` is a routing decision read from data, a random draw of a plan made for
    torch.compile (`draws_cached`), or a tensor taken out of one: the policy caches it
    (checkpoint would make the decision, or a traced recomputation the draw, again) unless the
    block overwrites it in place (then checkpoint replays it on bitwise-equal inputs)."""
    t = tuple_of(problem, v)
    return bool({Reason.DATA, Reason.COMPILED_DRAW} & {
        problem.ops[v].not_recomputable, None if t is None else problem.ops[t].not_recomputable})
