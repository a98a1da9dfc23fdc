"""remat's Inductor compilers keep each kernel where the plan ran it: no horizontal fusion of
kernels with others between them (remat.fx_passes.compiled.inductor, `_PlanKeepingChoices`).

Inductor alone fuses two kernels that read the same input up to 64 nodes apart and runs the
fused kernel at the earlier one's place, so the later kernel's output is made early and held
across the step's peak: a plan's recomputation placed just before its reader would then be
held from the first recomputation of the same inputs on. One compile each (C++ kernels).
"""
from __future__ import annotations

import torch
from torch.fx.experimental.proxy_tensor import make_fx

import remat.fx_passes.compiled.inductor as inductor
from remat.fx_passes.measuring.allocator import allocator_peak


def _step(x, wide, narrow):
    first = torch.sin(x)                     # a kernel reading x
    h = torch.relu(first @ wide) @ narrow   # the peak: a temporary four times x
    late = x * 3 + 1                          # reads x again, after the peak
    return ((h @ late.t()).sum(),)


def _inputs():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(256, 256, generator=g), torch.randn(256, 1024, generator=g) / 16,
            torch.randn(1024, 256, generator=g) / 32]


def _compiled_peak() -> tuple[int, torch.Tensor]:
    inputs = _inputs()
    forward, _ = inductor.inductor_compilers()
    compiled = forward(make_fx(_step)(*inputs), inputs)
    out: list = []
    peak = allocator_peak(lambda: out.append(compiled(list(inputs))[0]))
    return peak, out[0]


def test_a_later_kernel_is_not_fused_into_an_earlier_one_across_the_peak():
    peak, out = _compiled_peak()
    x = _inputs()[0]
    # In the graph's order the peak is the wide temporary (4 x) beside its matmul's input `first`
    # (x's size); `late`, made after it, is not live there.
    assert peak <= 5 * x.nbytes
    torch.testing.assert_close(out, _step(*_inputs())[0], rtol=1e-4, atol=1e-3)


def test_inductor_alone_holds_the_later_kernel_across_the_peak(monkeypatch):
    """The rule is what keeps the order: Inductor's own choices fuse `late` into `first`'s
    kernel and hold it across the peak (a kernel of x's size more)."""
    from torch._inductor.virtualized import V

    monkeypatch.setattr(inductor, "_plan_keeping_choices", lambda: type(V.choices)())
    peak, _ = _compiled_peak()
    assert peak >= 6 * _inputs()[0].nbytes
