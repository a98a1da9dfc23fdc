"""optimize(..., compile=True): a plan that Inductor runs, accepted on the allocator's reading.

One Inductor compile (a ResNet: convolutions, run channels-last by Inductor's layout
optimization, which a convolutional graph keeps, and BatchNorm, whose running statistics the plan's measured step must put
back); the repair loop's decisions on injected readings, without compiling; the setups that
are refused before any capture."""
from __future__ import annotations

import copy
import importlib

import pytest
import torch

import remat
from remat.errors import BudgetError, RematError
from remat.fx_passes.measuring.allocator import step_peak
from remat.planner.plans import step_reading
from remat.solvers import SolverOptions
from tests import models
from tests.gradients import CHANNELS_LAST_SUMS


def save_all_peak(model, inputs) -> int:
    return remat.optimize(model, activation_budget=10**12, example_inputs=inputs,
                          solver="save_all").activation_peak


def allocator_activations(module, model, inputs) -> int:
    for p in model.parameters():
        p.grad = None
    peak, loss = step_peak(lambda: module(*inputs), lambda out, seed: out.backward(seed))
    del loss
    return peak - sum(p.grad.untyped_storage().nbytes() for p in model.parameters())


@pytest.mark.slow
def test_compiled_plan_fits_by_the_allocator_and_trains_as_eager(tmp_path, monkeypatch):
    import torch._inductor.compile_fx as compile_fx

    compiled = []
    inner = compile_fx.compile_fx_inner

    def counting(gm, example_inputs, **kwargs):
        compiled.append(kwargs.get("is_backward", False))
        return inner(gm, example_inputs, **kwargs)

    monkeypatch.setattr(compile_fx, "compile_fx_inner", counting)
    model, inputs = models.resnet(batch=4, size=16)
    eager = copy.deepcopy(model)
    stats = [b.clone() for b in model.buffers()]
    budget = save_all_peak(model, inputs)
    plan = remat.optimize(model, activation_budget=budget, example_inputs=inputs,
                          compile=True, solver_options=SolverOptions(time_limit=20))
    # A forward and a backward compiled for every plan measured (more than one where a
    # reading was over the budget and the plan was made again).
    assert plan.compile
    assert sorted(compiled) == sorted([False, True] * len(plan.inductor.readings))
    compiles = len(compiled)
    # Planning ran a step and put the model back: running statistics as they were, no grads.
    assert all(torch.equal(a, b) for a, b in zip(stats, model.buffers()))
    assert all(p.grad is None for p in model.parameters())
    reading = plan.inductor.readings[-1]
    assert plan.activation_peak == reading.measured <= budget
    assert "compiled by Inductor" in plan.report().render()

    # A fresh step by the allocator, under Inductor (no new compile), within the plan's peak.
    assert allocator_activations(plan.module, model, inputs) <= plan.activation_peak
    assert len(compiled) == compiles
    # Its gradients are eager's, to Inductor's numerics: fused kernels sum in other orders,
    # channels-last (a convolutional graph keeps Inductor's layout optimization).
    for p in model.parameters():
        p.grad = None
    plan.module(*inputs).backward()
    eager(*inputs).backward()
    for (name, a), b in zip(eager.named_parameters(), model.parameters()):
        scale = max(a.grad.abs().max().item(), 1e-30)
        assert (a.grad - b.grad).abs().max().item() <= CHANNELS_LAST_SUMS * scale, name

    path = tmp_path / "resnet.json"
    plan.save(path)
    loaded = remat.load_plan(path, model)
    assert loaded.compile and loaded.inductor == plan.inductor
    assert loaded.activation_peak == plan.activation_peak


def injected(monkeypatch, readings):
    """measure_activations answering `readings(predicted)` in turn, no step run."""
    calls = []

    def measure(module, model, example_inputs, example_kwargs, loss_fn=None):
        calls.append(module)
        return readings[(len(calls) - 1) // 2]  # two calls per plan: warm-up, then the step

    monkeypatch.setattr(step_reading, "measure_activations", measure)
    return calls


def test_a_reading_over_the_budget_is_planned_again_with_room_for_the_excess(monkeypatch):
    model, inputs = models.mlp(batch=32, width=64, depth=6)
    with pytest.raises(BudgetError) as least:
        remat.optimize(model, activation_budget=1, example_inputs=inputs,
                       solver_options=SolverOptions(time_limit=10))
    budget = save_all_peak(model, inputs)  # the first plan saves all: room to recompute
    assert least.value.smallest < budget
    first = remat.optimize(model, activation_budget=budget, example_inputs=inputs,
                           solver_options=SolverOptions(time_limit=10))
    # The first compiled plan reads a byte over the budget, the second within it.
    injected(monkeypatch, [budget + 1, budget - 1])
    plan = remat.optimize(model, activation_budget=budget, example_inputs=inputs, compile=True,
                          solver_options=SolverOptions(time_limit=10))
    first_reading, second = plan.inductor.readings
    assert first_reading.predicted == first.activation_peak
    assert second.allowance_cut == budget + 1 - first_reading.predicted
    assert least.value.smallest <= second.predicted <= budget - second.allowance_cut
    assert plan.activation_peak == budget - 1  # the reading
    assert plan.memory.compiled_excess == budget - 1 - second.predicted


def test_a_reading_over_the_prediction_within_the_budget_is_the_plans_peak(monkeypatch):
    model, inputs = models.mlp(batch=32, width=64, depth=4)
    budget = save_all_peak(model, inputs) * 3 // 4
    plan = remat.optimize(model, activation_budget=budget, example_inputs=inputs,
                          solver_options=SolverOptions(time_limit=10))
    over = min(budget, plan.activation_peak + 1000)
    injected(monkeypatch, [over])
    compiled = remat.optimize(model, activation_budget=budget, example_inputs=inputs,
                              compile=True, solver_options=SolverOptions(time_limit=10))
    assert compiled.activation_peak == over
    assert compiled.memory.compiled_excess == over - compiled.inductor.predicted
    assert "above the simulated peak" in compiled.report().render()


def test_a_budget_below_the_least_simulated_peak_is_met_where_inductor_reads_below(
        monkeypatch):
    model, inputs = models.mlp(batch=32, width=64, depth=6)
    with pytest.raises(BudgetError) as least:
        remat.optimize(model, activation_budget=1, example_inputs=inputs,
                       solver_options=SolverOptions(time_limit=10))
    budget = least.value.smallest - 100
    injected(monkeypatch, [budget])  # fused, the least plan reads 100 bytes lower
    plan = remat.optimize(model, activation_budget=budget, example_inputs=inputs, compile=True,
                          solver_options=SolverOptions(time_limit=10))
    assert plan.inductor.predicted == least.value.smallest
    assert plan.activation_peak == budget
    assert "least simulated peak" in plan.report().render()
    injected(monkeypatch, [budget + 1])  # a byte over: the op-by-op refusal, with the reading
    with pytest.raises(BudgetError, match=r"op by op.*compiled, read") as e:
        remat.optimize(model, activation_budget=budget, example_inputs=inputs, compile=True,
                       solver_options=SolverOptions(time_limit=10))
    assert e.value.smallest == budget + 1


def test_the_least_a_budget_error_names_is_met_when_asked_for(monkeypatch):
    """Asked for less than anything reads, the error names the least plan's reading; asked
    for that, the same plan is made (deterministic mode at the least simulated peak) and its
    reading stands."""
    import remat.planner.optimize as optimize_module

    model, inputs = models.mlp(batch=32, width=64, depth=6)
    made = []
    plan_prepared = optimize_module.plan_prepared

    def recording(*args, **kwargs):
        plan = plan_prepared(*args, **kwargs)
        made.append((kwargs["solver_options"].deterministic, plan.schedule.saved,
                     plan.schedule.recomputed))
        return plan

    monkeypatch.setattr(optimize_module, "plan_prepared", recording)
    with pytest.raises(BudgetError) as least:
        remat.optimize(model, activation_budget=1, example_inputs=inputs,
                       solver_options=SolverOptions(time_limit=10))
    reading = least.value.smallest - 100  # fused, the least plan reads 100 bytes lower
    injected(monkeypatch, [reading])
    with pytest.raises(BudgetError) as error:
        remat.optimize(model, activation_budget=1, example_inputs=inputs, compile=True,
                       solver_options=SolverOptions(time_limit=10))
    assert error.value.smallest == reading
    first = made[-1]  # the plan at the least simulated peak, read
    assert first[0] is True
    made.clear()
    injected(monkeypatch, [reading])
    plan = remat.optimize(model, activation_budget=reading, example_inputs=inputs,
                          compile=True, solver_options=SolverOptions(time_limit=10))
    assert plan.activation_peak == reading
    assert made == [first]
    assert first[1:] == (plan.schedule.saved, plan.schedule.recomputed)


def test_the_least_plan_falls_back_to_the_wall_clock_search(monkeypatch):
    """Where deterministic mode finds no plan at the least simulated peak (one worker: a ViT
    beside busy processes), the wall-clock search's plan is the one read."""
    import remat.planner.optimize as optimize_module

    model, inputs = models.mlp(batch=32, width=64, depth=6)
    plan_prepared = optimize_module.plan_prepared
    modes = []

    def weaker(*args, **kwargs):
        modes.append(kwargs["solver_options"].deterministic)
        if kwargs["solver_options"].deterministic:
            raise BudgetError("deterministic mode found nothing here", budget=1, smallest=None)
        return plan_prepared(*args, **kwargs)

    with pytest.raises(BudgetError) as least:
        remat.optimize(model, activation_budget=1, example_inputs=inputs,
                       solver_options=SolverOptions(time_limit=10))
    reading = least.value.smallest - 100
    monkeypatch.setattr(optimize_module, "plan_prepared", weaker)
    injected(monkeypatch, [reading])
    plan = remat.optimize(model, activation_budget=reading, example_inputs=inputs,
                          compile=True, solver_options=SolverOptions(time_limit=10))
    assert plan.activation_peak == reading
    assert modes[-2:] == [True, None]


def test_the_least_plan_does_not_follow_the_wall_clock_search(monkeypatch):
    """The wall-clock search's least moves with the machine's load (a loaded search finds a
    worse one); the plan read for a budget below the least is the one at the deterministic
    search's least, the same whatever the wall-clock search named. The wall-clock search is
    played by a refusal naming a least of our choosing; deterministic mode gets the time it
    needs (1 deterministic second) and a wall clock 30 times that, which no load here cuts."""
    import remat.planner.optimize as optimize_module

    model, inputs = models.gpt()
    plan_prepared = optimize_module.plan_prepared
    save_all = save_all_peak(model, inputs)
    made = []

    def loaded(named):
        def solve(*args, **kwargs):
            if kwargs["solver_options"].deterministic is None:
                raise BudgetError("the wall-clock search, loaded", budget=1, smallest=named)
            plan = plan_prepared(*args, **kwargs)
            made.append((named, plan.activation_peak, plan.schedule.saved,
                         plan.schedule.recomputed))
            return plan
        return solve

    options = SolverOptions(time_limit=30, deterministic_time=1)
    for named in (save_all // 2, save_all * 3 // 4):
        monkeypatch.setattr(optimize_module, "plan_prepared", loaded(named))
        injected(monkeypatch, [2])  # over the budget: the least plan read, then refused
        with pytest.raises(BudgetError, match="compiled, read"):
            remat.optimize(model, activation_budget=1, example_inputs=inputs, compile=True,
                           solver_options=options)
    assert [m[0] for m in made] == [save_all // 2, save_all * 3 // 4]  # one plan read in each
    assert made[0][1:] == made[1][1:]
    assert made[0][1] < save_all // 2


@pytest.mark.parametrize("second_fits", [True, False])
def test_room_a_reading_leaves_is_given_back_while_it_gains(monkeypatch, second_fits):
    """A plan that reads far below its budget under Inductor is made again with that room:
    taken where it fits (fewer FLOPs), and its own room given back in turn; a plan so made
    that reads over the budget leaves the one before it standing, with its own reading."""
    import remat.planner.optimize as optimize_module

    model, inputs = models.mlp(batch=32, width=64, depth=4)
    budget = save_all_peak(model, inputs) * 3 // 4
    plan_prepared = optimize_module.plan_prepared
    made = []

    def recording(*args, **kwargs):
        made.append(plan_prepared(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(optimize_module, "plan_prepared", recording)
    first_reading = budget // 2
    second_reading = budget - 1 if second_fits else budget + 1
    # any plan made after the second reads over the budget
    injected(monkeypatch, [first_reading, second_reading] + [budget + 1] * 4)
    plan = remat.optimize(model, activation_budget=budget, example_inputs=inputs, compile=True,
                          solver_options=SolverOptions(time_limit=10))
    first, second = made[:2]
    assert first.recompute_flops > 0 and second.recompute_flops < first.recompute_flops
    readings = plan.inductor.readings
    (kept,), spent = [r for r in readings if not r.spent], [r for r in readings if r.spent]
    assert kept.measured == first_reading and not kept.spent
    assert spent[0].measured == second_reading
    assert spent[0].allowance_cut == first_reading - kept.predicted < 0  # the room, given back
    if second_fits:
        assert plan.schedule is second.schedule and plan.activation_peak == budget - 1
        assert readings[-1] is spent[0] and "to recompute less" in plan.report().render()
        # where the second left room and recomputes, a third was made and read over
        assert all(r.measured == budget + 1 for r in spent[1:])
        assert len(made) == 2 + len(spent[1:])
    else:
        assert plan.schedule is first.schedule and plan.activation_peak == first_reading
        assert readings[-1] is kept and len(spent) == 1


def test_readings_that_never_fit_are_a_budget_error_naming_them(monkeypatch):
    model, inputs = models.mlp(batch=32, width=64, depth=4)
    budget = save_all_peak(model, inputs) * 3 // 4
    injected(monkeypatch, [budget * 2] * 10)
    with pytest.raises(BudgetError, match=r"under Inductor.*measured against.*compile=False") \
            as e:
        remat.optimize(model, activation_budget=budget, example_inputs=inputs, compile=True,
                       solver_options=SolverOptions(time_limit=10))
    assert e.value.smallest == budget * 2 and e.value.proven is False


@pytest.mark.parametrize("kwargs,cause", [
    (dict(dynamic={"batch": (1, 8)}), "fixed shapes"),
    (dict(offload=True), "offload"),
    (dict(training=remat.Training(data_parallel=2, zero_stage=3)), "data-parallel"),
])
def test_setups_compile_cannot_honour_are_refused_before_capture(kwargs, cause, monkeypatch):
    def never(*args, **kw):
        raise AssertionError("captured")

    monkeypatch.setattr(importlib.import_module("remat.fx_passes.tracing.capture"), "capture",
                        never)
    model, inputs = models.mlp(batch=8, width=16, depth=2)
    with pytest.raises(RematError, match=cause):
        remat.optimize(model, activation_budget=10**9, example_inputs=inputs, compile=True,
                       **kwargs)


def test_meta_weights_are_refused_before_capture():
    with torch.device("meta"):
        model = models.MLPChain(width=16, depth=2)
    with pytest.raises(RematError, match="real weights"):
        remat.optimize(model, activation_budget=10**9,
                       example_inputs=(torch.randn(8, 16, device="meta"),) * 2, compile=True)


def test_a_step_that_fails_under_inductor_names_the_op_by_op_remedy(monkeypatch):
    def fails(*args, **kwargs):
        raise RuntimeError("C++ compile error\ndetails")

    monkeypatch.setattr(step_reading, "measure_activations", fails)
    model, inputs = models.mlp(batch=8, width=16, depth=2)
    with pytest.raises(RematError, match=r"failed under Inductor \(RuntimeError: C\+\+ compile "
                                         r"error\).*compile=False"):
        remat.optimize(model, activation_budget=10**9, example_inputs=inputs, compile=True)
