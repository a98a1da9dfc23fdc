"""Candidate plans of a pipeline stage whose schedule splits its backward (the zero-bubble
schedules' stages after the first), measured: checkpointing the first k of its blocks whole,
k = 0 .. all, each W in one recomputation group (`remat.fx_passes.eager.pipeline_apply`).

Selective policies cannot run there (torch recomputes a checkpointed block in I and again in W,
and the second recomputation finds the cached values consumed), and remat's simulator does not
model torch's split backward (one autograd call per parameter group in W), so each candidate's
passes are measured on the stage's real weights (`remat.fx_passes.eager.pipeline_probe`).
"""
from __future__ import annotations

from typing import Any, Sequence

from remat.errors import RematError
from remat.planner.parallel.stage import Candidate
from remat.solvers.core.blocks import block_of
from remat.solvers.timeline.pipeline_rank import MicrobatchMemory, Pass

__all__ = ["checkpoint_whole", "split_candidates", "whole_backward_at_weight"]


def checkpoint_whole(module: Any, paths: Sequence[str]) -> Any:
    from remat.fx_passes.eager.pipeline_apply import checkpoint_whole as wrap

    return wrap(module, paths)


def stage_blocks(module: Any) -> list[str]:
    """The stage's repeated blocks ("layers.3"), in forward order of their names."""
    found = {block_of(name) for name, _ in module.named_modules()}
    names = dict(module.named_modules())
    paths = [p for p in found if p and p in names]
    return sorted(paths, key=lambda p: [int(x) if x.isdigit() else x for x in p.split(".")])


def split_candidates(step: Any, inputs: Sequence[Any], *, prefix: str) -> list[Candidate]:
    from remat.fx_passes.eager.pipeline_probe import split_passes
    from remat.planner.plans.prepare import has_meta_weights

    if has_meta_weights(step.stage):
        raise RematError("a zero-bubble schedule's stages are planned from measured passes "
                         "(torch's split backward is not simulated): give the stages real "
                         "weights, or plan for 1F1B / Interleaved1F1B")
    blocks = stage_blocks(step.stage)
    out = []
    none_flops = None
    for k in range(len(blocks) + 1):
        whole = tuple(blocks[:k])
        p = split_passes(step, inputs, whole)
        none_flops = p.flops if none_flops is None else none_flops
        # The first W's (or B's) gradients stay, counted apart from the micro-batch.
        memory = MicrobatchMemory(
            forward=Pass(*p.forward), backward=Pass(p.backward[0], p.backward[1] - p.gradients),
            backward_accumulating=Pass(*p.backward_accumulating), gradients=p.gradients,
            input=Pass(*p.input), weight=Pass(p.weight[0], p.weight[1] - p.gradients),
            weight_accumulating=Pass(*p.weight_accumulating),
            recompute_flops=max(0, p.flops - none_flops), source="measured")
        name = ("no checkpoint" if k == 0 else f"checkpoint {', '.join(whole)} whole"
                if k < len(blocks) else "checkpoint every block (W grouped)")
        out.append(Candidate(name, memory, {}, whole=whole))  # measured: no seconds
    return out


def whole_backward_at_weight(memory: MicrobatchMemory) -> MicrobatchMemory:
    """The first stage's memory under a split-backward schedule: torch skips its I (the
    micro-batch holds what its forward left) and runs its whole backward at W."""
    from dataclasses import replace

    held = memory.forward.after
    return replace(memory, input=Pass(held, held), weight=memory.backward,
                   weight_accumulating=memory.backward_accumulating)

