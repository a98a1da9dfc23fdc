"""The zoo's CI subset: one architecture per family, built as transformers' own tests build
it (examples/zoo_models.py), planned in both execution modes; every row keeps the promise:
the allocator within [-2 %, 0] of the prediction and the gradients eager PyTorch's.
`python examples/hf_zoo.py` runs the whole zoo."""
import pytest
import torch

from examples.hf_zoo import activation_peak, gradient_bytes, run_arch, training_step
from examples.zoo_models import ARCHS, build
from remat.fx_passes.measuring.allocator import allocator_peak
from remat.solvers import SolverOptions

pytest.importorskip("transformers")

# the smallest architecture of each family that both modes plan at the zoo's budget
CI = {"decoder": "llama", "encoder": "distilbert", "encoder-decoder": "marian",
      "vision": "convnext", "MoE": "qwen3_moe", "SSM": "bamba"}


def test_the_zoo_has_every_family_and_forty_architectures():
    assert len(ARCHS) >= 40
    assert {family for family, _ in ARCHS.values()} == set(CI)
    assert all(ARCHS[name][0] == family for family, name in CI.items())


def test_activations_are_the_peak_less_the_gradients():
    model, kwargs = build("llama")
    step = training_step(model, kwargs, seed=7)
    step()  # lazy initialization outside the measurement
    activations = activation_peak(step, model)
    grads = gradient_bytes(model)
    assert grads == 4 * sum(p.numel() for p in model.parameters())  # fp32, all trainable
    model.zero_grad(set_to_none=True)
    whole = allocator_peak(step)
    assert activations == whole - grads and 0 < activations < whole


@pytest.mark.parametrize("family", sorted(CI))
def test_each_family_keeps_the_promise_in_both_modes(family):
    rows = run_arch(CI[family], SolverOptions(time_limit=2))
    assert [r.mode for r in rows] == ["compiled", "eager"]
    for row in rows:
        assert not row.error, row
        assert row.status, row
        assert 0.98 * row.predicted <= row.allocator <= row.predicted, row
        # MoE experts accumulate in a different order from step to step on the CPU
        assert row.grad_diff <= (1e-8 if family == "MoE" else 0.0), row
