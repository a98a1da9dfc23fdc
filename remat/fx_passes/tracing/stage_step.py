"""One pipeline stage's step for one micro-batch, as a module whose training step the capture can
trace: what `torch.distributed.pipelining` runs on a stage.

``StageStep(stage, *, output_grad=None, loss_fn=None)``
    ``forward(*inputs[, target]) -> (loss, output)``. A stage that is not the last ends its
    step where the runtime does: its backward starts from a gradient of its output received
    from the next stage. `Seed` stands for it: a scalar whose backward hands `output_grad` (a
    buffer: the runtime's receive buffer, allocated before the step) to the stage's output as
    its gradient, with no op of its own. The last stage's loss is the schedule's `loss_fn` of
    its output and the target. The output is returned too, so that the captured step holds it
    to the end of the backward, as the runtime's forward cache does (the last stage's output,
    the logits, included). A stage input that requires grad (every stage but the first) gets
    its gradient in the captured step, as the runtime computes it for the previous stage.

The stage's parameters keep their names under the prefix ``stage.`` (`PREFIX`).
"""
from __future__ import annotations

from typing import Callable

import torch

__all__ = ["PREFIX", "Seed", "StageStep"]

PREFIX = "stage."


class Seed(torch.autograd.Function):
    """A zero loss whose gradient with respect to `output` is `grad` itself."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(grad)
        return output.new_zeros(())

    @staticmethod
    def backward(ctx, _):
        (grad,) = ctx.saved_tensors
        return grad, None


class StageStep(torch.nn.Module):
    def __init__(self, stage: torch.nn.Module, *, output_grad: torch.Tensor | None = None,
                 loss_fn: Callable | None = None):
        super().__init__()
        if (output_grad is None) == (loss_fn is None):
            raise ValueError("StageStep: give output_grad (a stage before the last) or loss_fn "
                             "(the last stage), not both")
        self.stage = stage
        self.loss_fn = loss_fn
        if output_grad is not None:
            self.register_buffer("output_grad", output_grad, persistent=False)

    def forward(self, *inputs):
        if self.loss_fn is not None:
            *inputs, target = inputs
            output = self.stage(*inputs)
            return self.loss_fn(output, target), output
        output = self.stage(*inputs)
        return Seed.apply(output, self.output_grad), output
