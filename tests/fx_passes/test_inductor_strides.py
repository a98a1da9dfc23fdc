"""A compiled backward whose inputs come with other strides than the graph was traced with
(remat.fx_passes.compiled.inductor._decomposed): Inductor's forward chooses a saved value's
layout, and the backward's views were traced against the joint graph's strides. Retraced with
the handed-over strides, a view does not apply (transformers' ConvNeXt failed so under
compile=True); retraced with the traced ones, Inductor compiles for the real strides."""
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from remat.fx_passes.compiled.inductor import _decomposed, inductor_compilers

aten = torch.ops.aten


def scaled_flat(x):
    return (aten.view.default(aten.mul.Tensor(x, 2), [-1]),)


def test_a_graph_retraced_with_the_strides_it_was_traced_with():
    gm = make_fx(scaled_flat)(torch.randn(4, 6))
    saved = torch.randn(6, 4).t()  # the same shape, transposed strides
    mode = FakeTensorMode()
    fake = mode.from_tensor(saved)
    with pytest.raises(Exception, match="view"):  # the strides as handed over
        with mode:
            make_fx(gm)(fake)
    retraced = _decomposed(gm, [fake])
    assert [n.meta["val"].stride() for n in retraced.graph.nodes if n.op == "placeholder"] \
        == [(6, 1)]
    _, backward = inductor_compilers()
    compiled = backward(gm, [fake])
    (out,) = compiled([saved])
    assert torch.equal(out, saved.mul(2).reshape(-1))
