"""optimize(..., execution="eager", compile=True | "blocks"): an eager plan accepted on the
allocator's reading of ``torch.compile`` of the applied model, or of each of its blocks, the
way its user trains with it.

A real Inductor run for each (a small GPT, a plan that recomputes matmuls): the applied model,
compiled again from a fresh copy, reads within the plan's peak, the peak within the budget,
and the gradients are plain torch.compile's. The repair loop and the model's
unwrapping on injected readings, without compiling; the plan file; `remove_eager`."""
from __future__ import annotations

import copy

import pytest
import torch

import remat
from remat.errors import RematError
from remat.fx_passes.eager.apply import remove_eager
from remat.fx_passes.eager.call_guard import current
from remat.planner.plans import step_reading
from remat.solvers import SolverOptions
from tests import models


@pytest.fixture(scope="module")
def gpt():
    model, inputs = models.gpt(models.GPTConfig(dropout=0.0))
    save_all = remat.optimize(copy.deepcopy(model), activation_budget=10**12,
                              example_inputs=inputs, solver="save_all").activation_peak
    return model, inputs, save_all


def eager_plan(model, inputs, budget, **kwargs):
    return remat.optimize(model, activation_budget=budget, example_inputs=inputs,
                          execution="eager", solver_options=SolverOptions(time_limit=5),
                          **kwargs)


def grads_of(call, model, inputs) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    call(*inputs).backward()
    return {n.replace("_orig_mod.", ""): p.grad.clone() for n, p in model.named_parameters()}


def unwrapped(model) -> bool:
    """No block of `model` carries a remat wrapper, and the model no remat hook."""
    return (not hasattr(model, "_remat_applied")
            and not any(hasattr(m, "_remat_policy") or "forward" in m.__dict__
                        for m in model.modules())
            and not model._forward_pre_hooks and not model._forward_hooks)


def compiled_as_trained(model, plan, how):
    """`model` with `plan` applied and compiled as its user trains it: torch.compile of the
    model, or of each block in place (torchtitan's per-block compile)."""
    applied = plan.apply(model)
    if how is True:
        return torch.compile(applied)
    for block in applied.h:
        block.compile()
    return applied


@pytest.mark.slow
@pytest.mark.parametrize("how", [True, "blocks"])
def test_torch_compile_of_the_applied_plan_fits_by_the_allocator(gpt, how):
    model, inputs, save_all = gpt
    budget = int(0.6 * save_all)
    planned_on = copy.deepcopy(model)
    plan = eager_plan(planned_on, inputs, budget, compile=how)
    assert plan.compile == how and plan.inductor is not None
    assert plan.recompute_flops > 0  # the budget makes it recompute: the policies matter
    assert plan.activation_peak == plan.inductor.measured <= budget
    assert unwrapped(planned_on)  # planning measured the model and put it back
    # A fresh copy, applied and compiled as the user does, read by the allocator
    fresh = copy.deepcopy(model)
    compiled = compiled_as_trained(fresh, plan, how)
    for _ in range(2):  # the first call compiles
        read = step_reading.measure_activations(compiled, fresh, inputs, {})
    assert read <= plan.activation_peak
    # Gradients: plain torch.compile's, within Inductor's own reordered sums
    reference = copy.deepcopy(model)
    expected = grads_of(torch.compile(reference), reference, inputs)
    got = grads_of(compiled, fresh, inputs)
    largest = max(g.abs().max() for g in expected.values())
    assert max((got[n] - g).abs().max() for n, g in expected.items()) <= 1e-5 * largest
    # plan.module: the model the plan was made on, applied and compiled the same way
    if how is True:
        assert isinstance(plan.module, torch._dynamo.eval_frame.OptimizedModule)
    else:
        assert plan.module is planned_on
        assert all(block._compiled_call_impl is not None for block in planned_on.h)


def injected(monkeypatch, readings):
    """Readings answered in turn (two calls per plan: the warm-up, then the step), with the
    applied model run eagerly instead of compiled; each call notes whether the model was
    wrapped while it was read."""
    calls = []

    def measure(module, model, example_inputs, example_kwargs, loss_fn=None):
        calls.append(hasattr(model, "_remat_applied"))
        return readings[(len(calls) - 1) // 2]

    monkeypatch.setattr(step_reading, "compile_applied", lambda model, blocks=None: model)
    monkeypatch.setattr(step_reading, "measure_activations", measure)
    return calls


def test_blocks_are_compiled_in_place_only_for_the_reading(gpt, monkeypatch):
    model, inputs, save_all = gpt
    compiled = []

    def compile_applied(model, blocks=None):
        compiled.append(blocks)
        for path in blocks:
            model.get_submodule(path)._compiled_call_impl = model.get_submodule(path)._call_impl
        return model

    monkeypatch.setattr(step_reading, "compile_applied", compile_applied)
    planned_on = copy.deepcopy(model)
    plan = eager_plan(planned_on, inputs, save_all, compile="blocks")
    assert compiled[0] == sorted(plan.policies) == [f"h.{i}" for i in range(len(model.h))]
    # made for torch.compile: cached ops are PREFER_SAVE, for Inductor's partitioner
    assert all(current(p).prefer_save for p in plan.block_policies.values())
    assert all(block._compiled_call_impl is None for block in planned_on.h)
    assert unwrapped(planned_on)


def test_blocks_past_dynamos_recompile_limit_are_refused(gpt, monkeypatch):
    """Compiled one by one, each block with its own policy is a graph of its own: past
    torch._dynamo.config.recompile_limit dynamo would run the rest uncompiled, silently, and
    the reading would be eager PyTorch's. That is a RematError naming the limit."""
    model, inputs, save_all = gpt

    def compile_applied(model, blocks=None):  # AOTAutograd without Inductor: no C++ compile
        for path in blocks:
            model.get_submodule(path).compile(backend="aot_eager")
        return model

    monkeypatch.setattr(step_reading, "compile_applied", compile_applied)
    planned_on = copy.deepcopy(model)
    with torch._dynamo.config.patch(recompile_limit=len(model.h) - 1), \
            pytest.raises(RematError, match=rf"recompile_limit = {len(model.h) - 1}\).*at "
                                            rf"least {len(model.h)}"):
        eager_plan(planned_on, inputs, int(0.6 * save_all), compile="blocks")
    assert unwrapped(planned_on)


def test_blocks_compile_is_for_eager_plans(gpt):
    model, inputs, save_all = gpt
    with pytest.raises(ValueError, match="compile=True"):
        remat.optimize(model, activation_budget=save_all, example_inputs=inputs,
                       compile="blocks")
    with pytest.raises(ValueError, match="compile must be"):
        remat.optimize(model, activation_budget=save_all, example_inputs=inputs,
                       execution="eager", compile="model")


def test_a_reading_over_the_budget_is_planned_again_with_room(gpt, monkeypatch):
    model, inputs, save_all = gpt
    budget = int(0.8 * save_all)
    first = eager_plan(copy.deepcopy(model), inputs, budget)
    calls = injected(monkeypatch, [budget + 1, budget - 1])
    planned_on = copy.deepcopy(model)
    plan = eager_plan(planned_on, inputs, budget, compile=True)
    readings = plan.inductor.readings
    assert [r.measured for r in readings[:2]] == [budget + 1, budget - 1]
    # the second plan was made with the first's excess kept free below the allowance
    assert readings[1].allowance_cut == budget + 1 - readings[0].predicted > 0
    assert readings[1].predicted <= first.activation_peak
    assert all(calls)  # read with the plan applied ...
    assert unwrapped(planned_on)  # ... and unwrapped afterwards
    assert plan.activation_peak <= budget


def test_room_enough_for_the_unwrapped_model_recomputes_nothing(gpt, monkeypatch):
    """Compiled, the model with no block wrapped is plain torch.compile: where a reading leaves
    room for its eager peak, that plan is made, read, and stands."""
    model, inputs, save_all = gpt
    injected(monkeypatch, [1])
    unwrapped = eager_plan(copy.deepcopy(model), inputs, 10**12, compile=True)
    assert unwrapped.policies == {} and unwrapped.recompute_flops == 0
    budget = unwrapped.inductor.predicted * 3 // 4  # its eager peak does not fit
    injected(monkeypatch, [1, budget - 1])
    plan = eager_plan(copy.deepcopy(model), inputs, budget, compile=True)
    first, last = plan.inductor.readings
    assert first.measured == 1 and first.predicted <= budget  # the first plan recomputed
    assert last.spent and last.allowance_cut == 1 - first.predicted
    assert plan.policies == {} and plan.recompute_flops == 0
    assert plan.activation_peak == budget - 1


def test_a_failure_under_torch_compile_names_the_remedies(gpt, monkeypatch):
    model, inputs, save_all = gpt

    def fails(*args, **kwargs):
        raise RuntimeError("Tensor cached during selective activation checkpoint has been "
                           "mutated\nmore")

    monkeypatch.setattr(step_reading, "measure_activations", fails)
    planned_on = copy.deepcopy(model)
    with pytest.raises(RematError, match=r"failed under torch\.compile \(RuntimeError: Tensor "
                                         r"cached.*mutated\).*compile=False"):
        eager_plan(planned_on, inputs, save_all, compile=True)
    assert unwrapped(planned_on)


def test_the_plan_file_keeps_the_compiled_reading(gpt, monkeypatch, tmp_path):
    model, inputs, save_all = gpt
    injected(monkeypatch, [save_all // 2])
    planned_on = copy.deepcopy(model)
    plan = eager_plan(planned_on, inputs, save_all, compile=True)
    path = tmp_path / "plan.json"
    plan.save(path)
    loaded = remat.load_plan(path, copy.deepcopy(model))
    assert loaded.execution == "eager" and loaded.compile
    assert loaded.inductor == plan.inductor
    assert loaded.activation_peak == plan.activation_peak == save_all // 2


def test_remove_eager_unwraps_and_another_plan_applies(gpt):
    model, inputs, save_all = gpt
    plan = eager_plan(copy.deepcopy(model), inputs, int(0.6 * save_all))
    applied = copy.deepcopy(model)
    expected = grads_of(applied, applied, inputs)
    plan.apply(applied)
    assert not unwrapped(applied)
    assert grads_of(applied, applied, inputs).keys() == expected.keys()
    remove_eager(applied)
    assert unwrapped(applied)
    got = grads_of(applied, applied, inputs)  # plain eager again
    assert all(torch.equal(got[n], g) for n, g in expected.items())
    plan.apply(applied)  # applies again where it had been applied once
    remove_eager(applied)
    with pytest.raises(RematError, match="no remat plan is applied"):
        remove_eager(applied)
