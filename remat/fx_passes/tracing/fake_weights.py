"""Tracing a model without its weights: fake tensors stand in for meta ones while dynamo
traces (`remat.fx_passes.tracing.capture`), so a 7B model is planned without allocating a
weight."""
from __future__ import annotations

import contextlib

import torch

__all__ = ["fake_meta_tensors"]


@contextlib.contextmanager
def fake_meta_tensors(model: torch.nn.Module, inputs: tuple[tuple, dict], device: str):
    """Stand fake tensors on `device` in for meta parameters, buffers and inputs (`inputs` is
    ``(args, kwargs)``) while tracing.

    Tracing meta tensors directly loses backward formulas (under fake mode on the meta device
    nll_loss has no autograd kernel: cross-entropy then gets no gradient at all), so a model
    built on meta is traced as if on `device`, without allocating anything. Shared (tied)
    tensors stay shared; the model gets its meta tensors back afterwards."""
    args, kwargs = inputs
    tensors = [*model.parameters(), *model.buffers(), *args, *kwargs.values()]
    if not any(isinstance(t, torch.Tensor) and t.device.type == "meta" for t in tensors):
        yield inputs
        return
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    memo: dict[int, torch.Tensor] = {}

    def fake(t):
        if not isinstance(t, torch.Tensor) or t.device.type != "meta":
            return t
        if id(t) not in memo:
            with mode:
                new = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)
            if isinstance(t, torch.nn.Parameter):
                new = torch.nn.Parameter(new, requires_grad=t.requires_grad)
            memo[id(t)] = new
        return memo[id(t)]

    swapped = []
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for key, value in list(table.items()):
                if value is not None and value.device.type == "meta":
                    swapped.append((table, key, value))
                    table[key] = fake(value)
    try:
        yield tuple(fake(x) for x in args), {k: fake(v) for k, v in kwargs.items()}
    finally:
        for table, key, value in swapped:
            table[key] = value
