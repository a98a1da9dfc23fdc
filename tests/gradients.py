"""Gradients of a planned step against eager PyTorch's, by a bound that holds on any processor
and for any plan the solver may return within its limit.

A plan can run float sums in another order than eager PyTorch: the compiled step runs
AOTAutograd's decompositions, and mixture-of-experts layers accumulate their experts with
`index_put(accumulate=True)`, whose order on the CPU changes from call to call. In float32 a
sum of n terms reordered moves by about n * 1.2e-7 of the terms' size, so the bound is relative
to the largest gradient; a wrong recomputation (a stale value, another dropout mask) moves
gradients by a sizeable fraction of it, far above the bound."""
from __future__ import annotations

import torch

from examples.hf_zoo import grad_diff, gradients

# 1e-5 of the largest gradient: room for about a hundred terms summed in another order
REORDERED_SUMS = 1e-5
# A convolutional step compiled by Inductor with its layout optimization runs channels-last:
# BatchNorm's and the convolutions' weight gradients are sums over batch x height x width,
# taken in another order, of terms that cancel (a BatchNorm weight's gradient is the sum of
# the output gradient times the normalized input, which is zero-mean). Per parameter, relative
# to its largest gradient: 1.02e-5 measured on tests.models.resnet(batch=4, size=16).
CHANNELS_LAST_SUMS = 1e-4


def relative_grad_gap(model: torch.nn.Module, reference: torch.nn.Module) -> float:
    """The largest |difference| between the two models' gradients, relative to the largest
    |gradient| of `reference` (0 where they are bitwise equal)."""
    return grad_diff(gradients(reference), model)


__all__ = ["CHANNELS_LAST_SUMS", "REORDERED_SUMS", "relative_grad_gap"]
