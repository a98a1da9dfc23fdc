"""Checkpointing inside pipeline stages whose schedule splits the backward (the zero-bubble
schedules of `torch.distributed.pipelining`), and the fix that makes it pay.

What torch 2.13 does (measured, tests/planner/test_pipeline.py): a split backward is one
``torch.autograd.grad`` call for the input gradient (I, ``retain_graph=True``) and, for the
weight gradient (W), one call per parameter group (`stage_backward_weight`; 9 groups a Llama
layer). Non-reentrant checkpoint recomputes a block once per autograd call that unpacks one of
its tensors (its frames key the recomputation by graph task), and keeps every tensor of that
recomputation that the call does not unpack for as long as the micro-batch's graph lives, i.e.
to the end of its W. So a checkpointed block runs its forward again in I and then once per
parameter group in W, and W holds up to one recomputation per group: the 25-40 % higher stage
peak seen under InterleavedZeroBubble, ZBVZeroBubble and DualPipeV. Selective checkpointing
cannot run there at all: the second recomputation finds its cached values consumed ("Trying to
backward an extra time").

``group_weight_recomputation(stage)`` runs each W of a `PipelineStage` inside one
``torch.utils.checkpoint.GraphExecGroup``: its autograd calls share one recomputation per block
(the parameter groups' calls unpack disjoint tensors, as the group requires). A checkpointed
block then runs again once in I and once in W.

``checkpoint_whole(module, paths)`` wraps the named blocks' forwards in plain non-reentrant
checkpoint (no selective policy: the split backward recomputes twice).
"""
from __future__ import annotations

import functools
from typing import Any, Sequence

from remat.errors import RematError

__all__ = ["checkpoint_whole", "group_weight_recomputation"]


def _graph_exec_group():
    try:
        from torch.utils.checkpoint import GraphExecGroup
    except ImportError:
        raise RematError("this torch has no torch.utils.checkpoint.GraphExecGroup: a zero-bubble "
                         "stage's weight gradient would recompute each checkpointed block once "
                         "per parameter group; use torch >= 2.9, or a schedule with a whole "
                         "backward (1F1B, Interleaved1F1B)") from None
    return GraphExecGroup


def group_weight_recomputation(stage: Any) -> Any:
    """`stage` (a `torch.distributed.pipelining.PipelineStage`) with each W run in one
    recomputation group (module doc). Returns `stage`."""
    group = _graph_exec_group()
    if getattr(stage, "_remat_grouped_w", False):
        return stage
    weight = stage.backward_weight_one_chunk

    @functools.wraps(weight)
    def grouped(*args, **kwargs):
        with group():
            return weight(*args, **kwargs)

    stage.backward_weight_one_chunk = grouped
    stage._remat_grouped_w = True
    return stage


def checkpoint_whole(module: Any, paths: Sequence[str]) -> Any:
    """The blocks at `paths` in `module` wrapped in place in plain non-reentrant checkpoint."""
    from torch.utils.checkpoint import checkpoint

    for path in paths:
        block = module.get_submodule(path)
        if getattr(block, "_remat_policy", None) is not None:
            raise RematError(f"block {path!r} is already wrapped by a remat plan; apply a plan "
                             "once, to a fresh model")
        block._remat_policy = "whole"
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
    return module
