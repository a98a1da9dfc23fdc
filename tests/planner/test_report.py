"""optimize() end to end on small real models: the report's numbers are the plan's, the
gradients are counted once, the plan runs, meta models are refused, and nothing-fits errors
name the dominant term. Also the sweep (monotone) and max_batch."""
import dataclasses
import json

import pytest
import torch

import remat
from remat.errors import BudgetError, RematError
from remat.fx_passes.measuring.memory_tracker import MemoryTracker
from remat.planner.optimize import optimize
from remat.planner.plans.plan import plan_prepared
from remat.planner.plans.prepare import prepare
from remat.planner.plans.report import module_rows
from remat.planner.sweep import knee, max_batch, sweep_prepared
from remat.solvers import SolverOptions
from tests.models import gpt
# model_inputs and prepared are fixtures
from tests.planner.small_gpt import CONFIG, TRAINING, model_inputs, prepared  # noqa: F401

OPTIONS = SolverOptions(time_limit=20, workers=2)


def between_baselines(prepared):
    """An activation allowance halfway between checkpointing every block and saving all."""
    peaks = sorted(s.peak for s in prepared.baselines.values())
    return (peaks[0] + peaks[-1]) // 2 - prepared.graph_gradients


@pytest.fixture(scope="module")
def plan(model_inputs, prepared):
    model, _ = model_inputs
    return plan_prepared(model, prepared, budget=None,
                         activation_budget=between_baselines(prepared), target="h100",
                         solver_options=OPTIONS)


def test_report_numbers_are_the_plans(plan):
    report = plan.report()
    memory = report.plan_memory
    assert memory.total == plan.peak
    assert memory.activation_peak == plan.activation_peak
    assert memory.activation_peak == plan.schedule.peak - plan.prepared.graph_gradients
    assert report.price.recompute_flops == plan.recompute_flops
    assert report.price.model_flops == plan.problem.total_flops
    assert report.solver.status == plan.status.value and report.solver.gap == plan.gap
    rows = module_rows(plan.problem, plan.schedule)
    assert sum(r.count * r.bytes_recomputed for r in rows) == \
        sum(plan.problem.ops[v].size for v in plan.schedule.recomputed)
    assert sum(r.count * r.recompute_flops for r in rows) == plan.recompute_flops
    data = json.loads(json.dumps(report.to_dict()))
    assert data["memory"][0]["memory"]["total"] == plan.peak
    assert data["price"]["recompute_flops"] == plan.recompute_flops
    assert [c["name"] for c in data["memory"]] == ["plan", "save all", "checkpoint blocks"]
    text = report.render()
    for heading in ("Memory of one step", "The plan per module", "The price", "The solver",
                    "MFU", "HFU", "predicted"):
        assert heading in text


def test_report_states_the_limits_the_solver_ran_under(model_inputs, prepared, plan):
    """Given limits are stated as given; with no options, the limits chosen by the problem's
    size (`SolverOptions.by_size`) are stated; a deterministic plan says whether it repeats."""
    given = plan.report().solver
    assert (given.time_limit, given.limits) == (20, "relative gap chosen by problem size")
    model, _ = model_inputs
    default = plan_prepared(model, prepared, budget=None,
                            activation_budget=between_baselines(prepared), target="h100")
    summary = default.report().solver
    chosen = SolverOptions().by_size(len(prepared.problem))
    assert (summary.time_limit, summary.relative_gap) == (chosen.time_limit,
                                                          chosen.relative_gap)
    assert summary.limits == "chosen by problem size"
    text = default.report().render()
    assert f"{chosen.time_limit:g} s, {100 * chosen.relative_gap:g} % (chosen by problem size)" \
        in text
    assert summary.deterministic is None and "repeatable" not in text  # wall-clock mode
    repeatable = plan_prepared(model, prepared, budget=None,
                               activation_budget=between_baselines(prepared), target="h100",
                               solver_options=SolverOptions(deterministic=True))
    text = repeatable.report().render()
    if repeatable.report().solver.deterministic is True:
        assert "the same plan in any process" in text
    else:  # the wall clock cut it (a loaded machine): the report says the plan may differ
        assert "may differ from run to run" in text


def test_report_words_say_what_the_numbers_are(plan):
    text = plan.report().render()
    # "saved" means kept for the backward (PyTorch's word): the recomputed bytes are avoided.
    assert "memory avoided" in text and "kept for backward" in text
    assert "bytes saved" not in text
    # A roofline's MFU is a prediction for the target, and the title says so on a CPU run.
    assert not plan.prepared.profile.measured
    assert "MFU, predicted" in text and "HFU, predicted" in text
    assert "target H100 SXM (times predicted for it by a roofline" in text
    assert plan.training_mode == "train" and " in train mode:" in text


def test_gradients_shown_and_counted_once(plan):
    memory = plan.report().plan_memory
    rows = {name: (size, counted) for name, size, counted, _ in memory.rows()}
    assert memory.gradients_in_graph  # fp32 model, fp32 gradients: the graph's own
    assert rows["gradients"] == (memory.state.gradients, True)
    assert sum(size for size, counted in rows.values() if counted) == memory.total
    assert memory.graph_gradients == plan.prepared.graph_gradients
    # The graph's gradients are exactly the configuration's: one fp32 gradient per parameter
    # (the tied embedding once), so counting them inside the activation peak is complete.
    problem = plan.problem
    roots = {problem.root[i] for i, op in enumerate(problem.ops)
             if op.is_output and op.phase.value == "backward"}  # weight grads are often views
    graph_grads = sum(problem.ops[r].size for r in roots)
    assert graph_grads == memory.state.gradients == memory.graph_gradients


def test_the_plan_runs_and_its_measured_peak_is_the_simulated_one(plan, model_inputs):
    model, inputs = model_inputs
    model.zero_grad(set_to_none=True)
    expected = model(*inputs)
    expected.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    tracker = MemoryTracker()
    module = plan.module
    with module.instrument(lambda phase: tracker) as calls:
        loss = module(*inputs)
        loss.backward()
    assert calls.forward == 1 and calls.backward == 1
    # The tracker sees the graph's values, its gradients included: the simulated peak, less
    # the loss's seed, which autograd makes outside the graphs (the allocator sees it).
    seed = loss.numel() * loss.element_size()
    assert tracker.peak == plan.memory.simulated_peak - seed
    torch.testing.assert_close(loss, expected)
    for n, p in model.named_parameters():  # the module shares the model's parameters
        torch.testing.assert_close(p.grad, grads[n], rtol=1e-4, atol=1e-5)


def test_meta_model_refuses_module_and_applies_to_real_weights(model_inputs):
    with torch.device("meta"):
        meta_model = type(model_inputs[0])(CONFIG)
    _, inputs = model_inputs
    meta_inputs = tuple(x.to("meta") for x in inputs)
    plan = optimize(meta_model, activation_budget="100MB", example_inputs=meta_inputs,
                    training=TRAINING, solver="save_all")
    assert plan.peak > 0
    with pytest.raises(RematError, match=r"plan\.apply\(model\)"):
        plan.module
    real, real_inputs = gpt(CONFIG, batch=8)
    module = plan.apply(real)
    module(*real_inputs).backward()
    assert all(p.grad is not None for p in real.parameters())
    with pytest.raises(RematError, match="differ"):
        plan.apply(torch.nn.Linear(3, 3))


def test_exactly_one_budget(model_inputs):
    model, inputs = model_inputs
    with pytest.raises(ValueError, match="exactly one"):
        optimize(model, example_inputs=inputs)
    with pytest.raises(ValueError, match="exactly one"):
        optimize(model, "1GB", activation_budget="1GB", example_inputs=inputs)


def test_state_dominated_budget_error(model_inputs, prepared):
    model, _ = model_inputs
    budget = prepared.state.total // 2  # the state alone overflows
    with pytest.raises(BudgetError) as info:
        plan_prepared(model, prepared, budget=budget, activation_budget=None, target="h100",
                      solver="checkpoint_blocks")
    error = info.value
    assert error.budget == budget
    assert error.dominant == "optimizer state"
    assert "micro-batch" not in str(error)
    assert error.smallest > prepared.state.total
    assert f"{error.smallest:,}" in str(error)


def test_activation_dominated_budget_error(model_inputs, prepared):
    model, _ = model_inputs
    smallest_peak = prepared.baselines[remat.solvers.Strategy.CHECKPOINT_BLOCKS].peak
    budget = prepared.state.total + (smallest_peak - prepared.graph_gradients) // 4
    with pytest.raises(BudgetError) as info:
        plan_prepared(model, prepared, budget=budget, activation_budget=None, target="h100",
                      solver="checkpoint_blocks")
    error = info.value
    assert error.dominant == "activations"
    assert "micro-batch" in error.remedy
    # The smallest budget that fits is one the same strategy then meets.
    plan = plan_prepared(model, prepared, budget=error.smallest, activation_budget=None,
                         target="h100", solver="checkpoint_blocks")
    assert plan.peak <= error.smallest
    with pytest.raises(BudgetError):
        plan_prepared(model, prepared, budget=error.smallest - 1, activation_budget=None,
                      target="h100", solver="checkpoint_blocks")


def test_sweep_is_monotone(model_inputs, prepared):
    model, _ = model_inputs
    peaks = sorted(s.peak for s in prepared.baselines.values())
    fixed = prepared.state.total - prepared.state.gradients
    budgets = [fixed + peaks[0] * 9 // 10 + (peaks[-1] - peaks[0] * 9 // 10) * k // 5
               for k in range(6)]
    # Each plan starts from the one of the budget below (the sweep's hint), so that more
    # memory never costs more recompute, proven or not: 5 s a plan
    result = sweep_prepared(model, prepared, budgets, target="h100",
                            solver_options=dataclasses.replace(OPTIONS, time_limit=5))
    feasible = [p for p in result.points if p.feasible]
    assert len(feasible) >= 3
    for p in feasible:
        assert p.peak <= p.budget
    recompute = [p.recompute_pct for p in feasible]
    assert recompute == sorted(recompute, reverse=True)  # more memory, never more recompute
    assert result.smallest_feasible is not None
    assert result.smallest_feasible <= min(p.budget for p in feasible)
    assert not result.points[-1].recompute_pct  # save-all's budget: nothing to recompute
    data = json.loads(json.dumps(result.to_dict()))
    assert len(data["points"]) == len(budgets)
    assert "smallest budget that fits" in result.render()


def test_knee_of_a_curve():
    from remat.planner.sweep import Point
    points = [Point("optimal", b, b, needs=b, recompute_pct=r)
              for b, r in [(1, 40.0), (2, 10.0), (3, 5.0), (4, 2.0), (5, 0.0)]]
    assert knee(points).needs == 2
    assert knee(points[:2]) is None


def test_max_batch():
    small = dataclasses.replace(CONFIG, n_layer=1)  # a capture per size tried
    model, _ = gpt(small, batch=2)

    def make_inputs(n):
        return gpt(small, batch=n)[1]

    # batch 2 saves everything within the budget: doubling tries 1, 2, 4, bisection 3 (a
    # capture each)
    one = prepare(model, make_inputs(2), training=TRAINING)
    budget = one.state.total + one.baselines[remat.solvers.Strategy.SAVE_ALL].peak
    result = max_batch(model, budget, make_inputs=make_inputs, global_batch=100,
                       training=TRAINING, solver="save_all", limit=64)
    assert result.micro_batch >= 2
    assert (result.micro_batch, True) in result.tried
    assert all(not fits for n, fits in result.tried if n > result.micro_batch)
    assert result.accumulation_steps * result.micro_batch_used >= 100
    assert result.micro_batch_used <= result.micro_batch
    assert result.plan.peak <= budget
