"""examples/hf_zoo.py measures what `activation_budget` means (the step's peak less the state),
so that its "fits" column compares like with like, and its "feasible" column follows
per-block checkpointing and the proven floor."""
import copy

import pytest

from examples.hf_zoo import (activation_peak, build, feasibility, gradient_bytes, run_model,
                             training_step)
from remat.fx_passes.measuring.allocator import allocator_peak
from remat.solvers import SolverOptions, Strategy


def test_activations_are_the_peak_less_the_gradients():
    model, kwargs = build("vit")
    step = training_step(model, kwargs, seed=7)
    step()  # lazy initialization outside the measurement
    activations = activation_peak(step, model)
    grads = gradient_bytes(model)
    assert grads == 4 * sum(p.numel() for p in model.parameters())  # fp32, all trainable
    model.zero_grad(set_to_none=True)
    whole = allocator_peak(step)
    assert activations == whole - grads and 0 < activations < whole


@pytest.mark.slow
def test_a_budget_per_block_checkpointing_fits_gets_a_plan_within_it():
    """ViT at 60 % of eager's activations: checkpoint_blocks fits, so the row must have a plan
    whose allocator-measured activations are within the budget and gradients equal eager's."""
    [row] = run_model("vit", [0.6], SolverOptions(time_limit=5))
    assert row.feasible == "blocks", row
    assert not row.error and row.status, row
    assert row.peak <= row.budget, row
    assert row.peak <= row.predicted + 64, row  # the allocator agrees with the simulation
    assert row.grad_diff == 0.0, row


def test_feasibility_says_no_below_the_proven_floor():
    from remat.planner.prepare import prepare

    model, kwargs = build("vit")
    prepared = prepare(copy.deepcopy(model), example_kwargs=kwargs)
    verdict, floor = feasibility(prepared, 0, seconds=1.0)
    assert floor > 0 and verdict == "no"
    grads = prepared.graph_gradients
    blocks = prepared.baselines[Strategy.CHECKPOINT_BLOCKS].peak - grads
    assert feasibility(prepared, blocks, seconds=1.0)[0] == "blocks"
    assert feasibility(prepared, blocks - 1, seconds=1.0)[0] in ("open", "no")
