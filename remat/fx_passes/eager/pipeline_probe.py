"""One micro-batch's passes on a pipeline stage whose backward is split (I, then W), measured by
the allocator: what the zero-bubble schedules run, which remat's simulator does not model
(torch's W is one autograd call per parameter group, and checkpoint recomputes per call:
`remat.fx_passes.eager.pipeline_apply`).

``split_passes(step, inputs, whole) -> SplitPasses``
    `step` is the stage's `remat.fx_passes.tracing.stage_step.StageStep` (its stage, and the
    output gradient or the loss), `inputs` the stage's inputs for one micro-batch (with the
    target for the last stage), `whole` the block paths (in the stage module) to checkpoint
    whole. Runs, on a copy of the stage, two micro-batches through F, I and W as
    `PipelineStage` runs them with `torch.distributed.pipelining`'s own `stage_backward_input`
    and `stage_backward_weight` (W in one recomputation group), and returns each pass's peak
    and what it leaves, from the allocator's events: the first micro-batch's W makes the
    gradients (they stay), the second's adds to them. What the runtime hands on is left out
    (the input gradient, which its send keeps; the last stage's logits after I), as
    `remat.solvers.timeline.pipeline_rank.Kept` counts it. Also the FLOPs of the three passes.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from remat.fx_passes.measuring.allocator import cpu_memory_events
from remat.fx_passes.measuring.storage import distinct_storage_bytes

__all__ = ["SplitPasses", "split_passes"]


@dataclass(frozen=True)
class SplitPasses:
    """(peak, after) in bytes above what the micro-batch found, per pass."""

    forward: tuple[int, int]
    input: tuple[int, int]
    weight: tuple[int, int]
    """The first micro-batch's W: the gradients it makes are in its peak and after."""
    weight_accumulating: tuple[int, int]
    backward: tuple[int, int]
    """The whole backward (B) of a micro-batch, first (it makes the gradients) and later."""
    backward_accumulating: tuple[int, int]
    gradients: int
    flops: int
    """FLOPs of F, I and W of one micro-batch (matmuls and attention)."""


def split_passes(step: Any, inputs: Sequence[Any], whole: Sequence[str]) -> SplitPasses:
    runs = {}
    for sequence in (("F", "I", "W"), ("F", "B")):
        passes, stage = _fresh(step, inputs, whole)
        run = {"F": passes.forward, "I": passes.input, "W": passes.weight,
               "B": passes.backward}
        windows: list[tuple[str, list]] = []
        for mb in range(2):
            for name in sequence:
                with cpu_memory_events() as events:
                    run[name]()
                windows.append((f"{name}{mb}", events))
        runs.update(_passes_of(windows))
        gradients = distinct_storage_bytes(p.grad for p in stage.parameters())
    return SplitPasses(forward=runs["F1"], input=runs["I1"], weight=runs["W0"],
                       weight_accumulating=runs["W1"], backward=runs["B0"],
                       backward_accumulating=runs["B1"], gradients=gradients,
                       flops=_flops(step, inputs, whole))


def _fresh(step: Any, inputs: Sequence[Any], whole: Sequence[str]):
    """The passes of a copy of the stage with `whole` checkpointed, on copies of `inputs`
    (the runtime's receive buffers: allocated before the step)."""
    from remat.fx_passes.eager.pipeline_apply import checkpoint_whole

    stage = copy.deepcopy(step.stage)
    checkpoint_whole(stage, whole)
    is_last = step.loss_fn is not None
    args = [a.detach().clone().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor)
            else a for a in (inputs[:-1] if is_last else inputs)]
    grad = None if is_last else [torch.zeros_like(step.output_grad)]
    return _Passes(stage, args, inputs[-1] if is_last else None, grad, step.loss_fn), stage


def _passes_of(windows: list[tuple[str, list]]) -> dict[str, tuple[int, int]]:
    """(peak, after) of each window above what its micro-batch found. Each free takes the
    size its block was allocated with in an earlier or the same window
    (remat.fx_passes.measuring.allocator.paired's rule, across the windows)."""
    blocks: dict[int, int] = {}
    out, base, live = {}, {}, 0
    for name, events in windows:
        mb = name[1:]
        base.setdefault(mb, live)
        top = live
        for ptr, size in events:
            if size > 0:
                blocks[ptr] = size
                live += size
            elif ptr in blocks:
                live -= blocks.pop(ptr)
            top = max(top, live)
        out[name] = (top - base[mb], live - base[mb])
    return out


class _Passes:
    """F, I and W of one micro-batch after another, as `PipelineStage` runs them."""

    def __init__(self, stage, args, target, grad, loss_fn: Callable | None):
        self.stage, self.args, self.target, self.grad, self.loss_fn = (
            stage, args, target, grad, loss_fn)
        self.state: dict = {}

    def forward(self) -> None:
        output = self.stage(*self.args)
        self.state["output"] = output
        if self.loss_fn is not None:
            self.state["loss"] = self.loss_fn(output, self.target)

    def input(self) -> None:
        from torch.distributed.pipelining._backward import stage_backward_input

        s = self.state
        outputs = [s["loss"]] if self.loss_fn is not None else [s["output"]]
        inputs = [a for a in self.args if isinstance(a, torch.Tensor)]
        if any(a.requires_grad for a in inputs):
            dinputs, groups = stage_backward_input(outputs, self.grad, inputs,
                                                   self.stage.parameters())
            s["groups"] = groups
            del dinputs
            for a in inputs:
                a.grad = None  # handed on to the previous stage: its send keeps it (Kept)
        else:  # the first stage: torch skips I and runs the whole backward at W
            s["groups"] = None
        if self.loss_fn is not None:
            s.pop("output")  # the logits: the runtime's backward drops them here

    def backward(self) -> None:
        """The whole backward (B), as `stage_backward` runs it."""
        from torch.distributed.pipelining._backward import stage_backward

        s = self.state
        output = s["loss"] if self.loss_fn is not None else s["output"]
        inputs = [a for a in self.args if isinstance(a, torch.Tensor)]
        stage_backward(output, None if self.loss_fn is not None else self.grad[0], inputs)
        for a in inputs:
            a.grad = None  # handed on to the previous stage: its send keeps it (Kept)
        s.clear()

    def weight(self) -> None:
        from torch.distributed.pipelining._backward import (stage_backward,
                                                           stage_backward_weight)
        from remat.fx_passes.eager.pipeline_apply import _graph_exec_group

        s = self.state
        with _graph_exec_group()():
            if s["groups"] is None:
                output = s["loss"] if self.loss_fn is not None else s["output"]
                stage_backward(output, None if self.loss_fn is not None else self.grad[0],
                               [a for a in self.args if isinstance(a, torch.Tensor)])
            else:
                stage_backward_weight(self.stage.parameters(), s["groups"])
        s.clear()


def _flops(step: Any, inputs: Sequence[Any], whole: Sequence[str]) -> int:
    """FLOPs of F, I and W of one micro-batch, counted in a run of their own (remat's
    counter, which neither decomposes ops nor tracks modules: torch's FlopCounterMode fails
    inside autograd.grad with inputs, "A leaf node was passed to _will_engine_execute_node")."""
    from remat.fx_passes.eager.pipeline_apply import checkpoint_whole
    from remat.fx_passes.measuring.flops import FlopCounter

    stage = copy.deepcopy(step.stage)
    checkpoint_whole(stage, whole)
    is_last = step.loss_fn is not None
    args = [a.detach().clone().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor)
            else a for a in (inputs[:-1] if is_last else inputs)]
    passes = _Passes(stage, args, inputs[-1] if is_last else None,
                     None if is_last else [torch.zeros_like(step.output_grad)], step.loss_fn)
    counter = FlopCounter()
    with counter:
        passes.forward()
        passes.input()
        passes.weight()
    return counter.total
