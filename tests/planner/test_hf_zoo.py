"""The zoo's CI subset: one architecture per family, built as transformers' own tests build
it (examples/zoo_models.py), planned in both execution modes, each at a budget from its own
mode's range; every row keeps the promise: the allocator within [-2 %, 0] of the prediction
and the gradients eager PyTorch's.
`python examples/hf_zoo.py` runs the whole zoo."""
import pytest

from examples.hf_zoo import activation_peak, gradient_bytes, run_arch, training_step
from examples.zoo_models import ARCHS, build
from remat.fx_passes.measuring.allocator import allocator_peak
from remat.solvers import SolverOptions
from tests.gradients import REORDERED_SUMS

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


# the families whose rows also search both modes' least budgets (a few seconds each): three
# structures (causal blocks, an encoder feeding a decoder's cross-attention, routed experts);
# the whole zoo searches every architecture's
LEAST = {"decoder", "encoder-decoder", "MoE"}


@pytest.mark.parametrize("family", sorted(CI))
def test_each_family_keeps_the_promise_in_both_modes(family):
    rows = run_arch(CI[family], SolverOptions(time_limit=2), least=family in LEAST)
    assert [r.mode for r in rows] == ["compiled", "eager"]
    for row in rows:
        assert not row.error, row
        assert row.status, row
        assert row.blocks_peak <= row.budget <= max(row.blocks_peak, row.save_all_peak), row
        if family in LEAST:
            # the least search starts from caching nothing: never above checkpointing every
            # block
            assert row.least_compiled > 0 and 0 < row.least_eager <= rows[1].blocks_peak, row
            proven = (row.least_eager_proven if row.mode == "eager"
                      else row.least_compiled_proven)
            least = row.least_eager if row.mode == "eager" else row.least_compiled
            assert not proven or least <= row.predicted, row
        assert 0.98 * row.predicted <= row.allocator <= row.predicted, row
        # MoE experts accumulate in a different order from step to step on the CPU (relative
        # to the gradients' size); elsewhere the plan runs eager's kernels: bitwise equal
        assert row.grad_diff <= (REORDERED_SUMS if family == "MoE" else 0.0), row


def test_an_eager_range_that_runs_down_gets_checkpointings_peak():
    """DeepSeek-V3's eager step (2 layers) holds more with every block checkpointed than with
    none (remat's eager timeline): the budget is per-block checkpointing's peak, which eager
    plans meet, not a point below it that none can."""
    row, = run_arch("deepseek_v3", SolverOptions(time_limit=2), modes=("eager",),
                    least=False)
    assert row.save_all_peak < row.blocks_peak == row.budget, row
    assert not row.error and row.predicted <= row.budget, row
