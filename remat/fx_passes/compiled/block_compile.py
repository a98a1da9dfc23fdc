"""Compile each block of a model with remat's partitioner, as torchtitan compiles the blocks
of a model it then shards with FSDP2 (`fully_shard` after `torch.compile` per block).

The plan is made on the whole model's joint graph; a block compiled on its own gives
AOTAutograd another joint graph: the block's parameters and inputs as primals, the gradient
of its output as tangent. Its forward ops are the plan's ops of that block, in the same order
(both are the same code traced the same way); `block_partition_fn` checks that op by op,
lowers the block's graph to a problem of its own, and partitions it so that the forward
keeps what the plan keeps of that block (`kept`, by forward position) and the backward
recomputes the rest that it needs, each just before its first use. FSDP2's hooks stay outside
the compiled region (only the block's `forward` is compiled), as they must: they are
dynamo-disabled in torch 2.13.
"""
from __future__ import annotations

import contextlib
import logging
import types
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import fx

from remat.errors import RematError
from remat.fx_passes.tracing.capture import Captured
from remat.fx_passes.tracing.joint_passes import prepare_joint
from remat.fx_passes.lowering.lower import lower
from remat.fx_passes.compiled.joint_graph import mutated_inputs
from remat.fx_passes.compiled.planned import _Hooks, _instrumented
from remat.fx_passes.compiled.rewrite import Partition, partition
from remat.fx_passes.tracing.step_io import remat_error
from remat.solvers.core.problem import Phase
from remat.solvers.core.schedule import drop_unneeded, recomputable
from remat.solvers.timeline.evaluate import make_schedule

log = logging.getLogger(__name__)

__all__ = ["BlockPlan", "aligned_kept", "block_partition_fn", "compile_block",
           "compile_model_blocks"]


@dataclass(frozen=True)
class BlockPlan:
    """What the plan decided for one block: `targets[k]` is the k-th forward op of the block
    (as `Op.target` spells it) and `kept` the positions whose values the forward keeps for the
    backward; every other value the backward needs is recomputed."""

    path: str
    targets: tuple[str, ...]
    kept: frozenset[int]


def block_partition_fn(plan: BlockPlan, on_partition: Callable[[Partition], None]) -> Callable:
    """A `partition_fn` for `aot_autograd` that runs `plan` on the block's joint graph."""

    def apply(joint: fx.GraphModule, _inputs: Any, *, num_fwd_outputs: int, **_unused: Any):
        prepare_joint(joint)  # generator snapshots, as the plan's capture made them
        # The inputs the block overwrites (BatchNorm's running statistics, copied into the
        # buffers as the forward returns): what reads them must be kept, not recomputed.
        mutated = mutated_inputs(joint)
        captured = Captured(graph_module=joint, num_fwd_outputs=num_fwd_outputs,
                            num_mutation_outputs=len(mutated), mutated_inputs=mutated,
                            model_name=plan.path, device="meta")  # meta: no scratch runs
        problem = lower(captured)
        forward = [v for v, op in enumerate(problem.ops) if op.phase is Phase.FORWARD]
        targets = tuple(problem.ops[v].target for v in forward)
        kept = plan.kept if targets == plan.targets else aligned_kept(
            plan, targets, _from_nothing(joint, problem, forward), _unread(problem, forward))
        candidates = set(recomputable(problem))
        recomputed = drop_unneeded(problem, {v for k, v in enumerate(forward)
                                             if k not in kept and v in candidates})
        try:
            schedule = make_schedule(problem, recomputed)
        except ValueError as e:
            raise RematError(f"compile_blocks: block {plan.path!r}: the plan cannot run on the "
                             f"block's compiled graph: {e}") from None
        result = partition(joint, problem, schedule, num_fwd_outputs=num_fwd_outputs,
                           mutated_inputs=mutated)
        log.info("compiled block %s: %d saved, %d recomputed", plan.path, len(result.saved),
                 len(result.recomputed))
        on_partition(result)
        return result.forward, result.backward

    return apply


def aligned_kept(plan: BlockPlan, targets: tuple[str, ...],
                 from_nothing: frozenset[int] = frozenset(),
                 unread: frozenset[int] = frozenset()) -> frozenset[int]:
    """The positions of the block's compiled forward ops (`targets`) that keep their values,
    where the compiled block runs other ops than the plan's capture traced. Hugging Face
    models build the attention mask outside the blocks, materialized when the whole model is
    traced and None when a block is compiled alone (an all-ones padding mask), so the block
    runs its attention without the mask's ops, or builds a causal mask of its own (SDPA's
    ``is_causal`` decomposed: ``ones``, ``tril``, ``where``). The ops in `from_nothing`
    (positions computed from no input of the block: such a mask) are not the plan's and not
    kept, recomputed where the backward needs them, at no cost in kept memory; where every
    other compiled op is one of the plan's, in order, each follows the plan's decision, with a
    warning naming the first difference. A compiled op the plan never saw is also accepted,
    not kept, where it is in `unread` (positions whose values no backward op needs, directly
    or through another forward op): an output of the block that the model's loss never reads
    (Swin's stages return their output reshaped as well, which the plan's capture of the whole
    step drops as dead code), whose value needs no decision. Any other compiled op the plan
    never saw is refused (its decision would be a guess)."""
    import difflib

    rest = [k for k in range(len(targets)) if k not in from_nothing]
    matcher = difflib.SequenceMatcher(a=plan.targets, b=tuple(targets[k] for k in rest),
                                      autojunk=False)
    opcodes = matcher.get_opcodes()
    # (compiled position, the plan's position there) of each compiled op the plan never saw
    unplanned = [(rest[b0 + k], a0 + k if tag == "replace" and a0 + k < a1 else a0)
                 for tag, a0, a1, b0, b1 in opcodes if tag in ("insert", "replace")
                 for k in range(b1 - b0)]
    guessed = next(((k, a) for k, a in unplanned if k not in unread), None)
    if guessed is not None:
        k, a = guessed
        raise RematError(
            f"compile_blocks: block {plan.path!r} compiled to {len(targets)} forward ops "
            f"where the plan has {len(plan.targets)}; op {k} is {targets[k]} where the plan "
            f"has {plan.targets[a] if a < len(plan.targets) else 'nothing more'}: plan with "
            "the inputs and settings you train with")
    kept = frozenset(rest[b0 + k] for tag, a0, _, b0, b1 in opcodes if tag == "equal"
                     for k in range(b1 - b0) if a0 + k in plan.kept)
    dropped = next((op for op in opcodes if op[0] in ("delete", "replace")), None)
    if dropped is not None:
        log.warning("compile_blocks: block %r compiled to %d forward ops where the plan has "
                    "%d: from op %d (%s) the plan's capture traced ops this block does not "
                    "run; the others follow the plan", plan.path, len(targets),
                    len(plan.targets), dropped[1], plan.targets[dropped[1]])
    if from_nothing:
        first = min(from_nothing)
        log.warning("compile_blocks: block %r compiled to %d forward ops where the plan has "
                    "%d: %d computed from no input of the block (from op %d, %s), not kept; "
                    "the others follow the plan", plan.path, len(targets), len(plan.targets),
                    len(from_nothing), first, targets[first])
    if unplanned:
        log.warning("compile_blocks: block %r compiled to %d forward ops where the plan has "
                    "%d: %d the plan never saw and no backward op needs (from op %d, %s), "
                    "not kept; the others follow the plan", plan.path, len(targets),
                    len(plan.targets), len(unplanned), unplanned[0][0],
                    targets[unplanned[0][0]])
    return kept


def _unread(problem, forward: list[int]) -> frozenset[int]:
    """The positions in `forward` (the problem's forward ops, in order) of the ops whose values
    no backward op needs: none reads them, nor any forward op whose value the backward needs."""
    needed: set[int] = set()
    users = problem.users
    for v in reversed(range(len(problem.ops))):  # every reader comes after what it reads
        if any(problem.ops[u].phase is not Phase.FORWARD or u in needed for u in users[v]):
            needed.add(v)
    return frozenset(k for k, v in enumerate(forward) if v not in needed)


def _from_nothing(joint: fx.GraphModule, problem, forward: list[int]) -> frozenset[int]:
    """The positions in `forward` (the problem's forward ops) of the ops whose values depend on
    no placeholder of `joint` and that may be recomputed: constants the block makes (a causal
    mask), whatever its inputs. A generator snapshot and what draws from it are not."""
    fixed = {op.name for op in problem.ops if op.not_recomputable is not None}
    free: dict[fx.Node, bool] = {}
    for node in joint.graph.nodes:
        free[node] = (node.op != "placeholder" and node.name not in fixed
                      and all(free[a] for a in node.all_input_nodes))
    by_name = {n.name: n for n in joint.graph.nodes}
    return frozenset(k for k, v in enumerate(forward) if free[by_name[problem.ops[v].name]])


def compile_block(module: torch.nn.Module, plan: BlockPlan,
                  partitions: dict[str, list[Partition]], *, inductor: bool = False) -> None:
    """Replace `module.forward` by its compilation under `plan`: op by op (`boxed_nop`: each
    value freed after its last use) or, with `inductor`, by Inductor; every partition made is
    appended to `partitions[plan.path]`. The module's hooks (FSDP2's) stay outside the
    compiled call."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.backends.debugging import boxed_nop

    from remat.fx_passes.compiled.inductor import inductor_compilers

    if getattr(module, "_remat_policy", None) is not None or hasattr(module, "_remat_block"):
        raise RematError(f"block {plan.path!r} is already wrapped by a remat plan; apply or "
                         "compile a plan once, to a fresh model")
    made = partitions.setdefault(plan.path, [])
    # Counting the forward graph's calls proves that the compiled block, not its Python
    # code, ran (an instrument that does nothing, entered at each call, counts them).
    hooks = _Hooks(instruments=[contextlib.nullcontext()])
    fw, bw = inductor_compilers() if inductor else (boxed_nop, boxed_nop)
    backend = aot_autograd(fw_compiler=_instrumented(fw, "forward", hooks), bw_compiler=bw,
                           partition_fn=block_partition_fn(plan, made.append))
    compiled = torch.compile(_own_code(module.forward, plan.path), backend=backend)

    def forward(*args: Any, **kwargs: Any) -> Any:
        before = hooks.calls.forward
        try:
            out = compiled(*args, **kwargs)
        except Exception as e:  # dynamo wraps the partitioner's RematError: raise that
            inner = remat_error(e)
            if inner is not None and inner is not e:
                raise inner from e
            raise
        if hooks.calls.forward == before and torch.is_grad_enabled():
            # dynamo ran the block's Python code instead (past its recompile limit, or under
            # a dispatch mode): the plan would be silently dropped.
            raise RematError(
                f"compile_blocks: block {plan.path!r} ran without remat's partitioner "
                "(torch.compile ran its forward uncompiled: see TORCH_LOGS=recompiles; a "
                "dispatch mode around the call does it too); use plan.apply(model) (eager "
                "checkpointing) instead")
        return out

    module._remat_block = plan
    module.forward = forward


def _own_code(forward: Callable, path: str) -> Callable:
    """A call of `forward` through a function with a code object of its own. Dynamo caches
    compilations per code object, and every block runs the same `forward` code: compiled with
    a backend per block, all blocks would share one cache and its recompile limit (8 by
    default), and the ninth block would run uncompiled."""

    def call(*args: Any, **kwargs: Any) -> Any:
        return forward(*args, **kwargs)

    code = call.__code__.replace(co_name=f"remat_block_{path.replace('.', '_')}")
    return types.FunctionType(code, call.__globals__, code.co_name, call.__defaults__,
                              call.__closure__)


def compile_model_blocks(model: torch.nn.Module, plans: dict[str, BlockPlan], *,
                         inductor: bool = False) -> torch.nn.Module:
    """`compile_block` for every block in `plans`; `model.remat_partitions` collects the
    partitions. Returns `model`."""
    partitions: dict[str, list[Partition]] = {}
    for path, plan in plans.items():
        compile_block(model.get_submodule(path), plan, partitions, inductor=inductor)
    model.remat_partitions = partitions
    return model
