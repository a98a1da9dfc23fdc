"""The rewrite runs exactly the schedule: eager gradients, simulated memory, the saved set.

Every model is captured and lowered once (module cache) and each test works on deep copies,
so no test sees another's gradients, BatchNorm statistics or optimizer state.
"""
from __future__ import annotations

import copy
import functools
import operator
from dataclasses import replace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from remat.errors import BudgetError, RematError
from remat.fx_passes.tracing.capture import capture, default_loss
from remat.fx_passes.lowering.lower import lower
from remat.fx_passes.compiled.measure_step import measure_step
from remat.fx_passes.compiled.planned import planned_module
from remat.fx_passes.compiled.rewrite import RECOMPUTE
from remat.solvers import SolverOptions, solve
from remat.solvers.core.problem import Kind, Problem, Reason
from remat.solvers.core.schedule import drop_unneeded, recomputable
from remat.solvers.timeline.evaluate import make_schedule
from remat.solvers.timeline.simulate import StepKind, simulate, step_order
from tests import models

MiB = 2**20


@functools.cache
def planned(name: str):
    """(model, inputs, problem) for a test model; the first float input requires grad so that
    input gradients are part of the step."""
    model, inputs = getattr(models, name)()
    inputs = tuple(x.clone().requires_grad_(i == 0 and x.is_floating_point())
                   if isinstance(x, torch.Tensor) else x for i, x in enumerate(inputs))
    return model, inputs, lower(capture(model, inputs))


def save_all(problem: Problem):
    return make_schedule(problem, (), budget=None)


def recompute_all(problem: Problem):
    return make_schedule(problem, drop_unneeded(problem, recomputable(problem)))


def strategy(problem: Problem, name: str, fraction: float):
    """`name`'s schedule at `fraction` of the save-all peak, or at the smallest budget it fits."""
    budget = int(save_all_peak(problem) * fraction)
    # An explicit hint: the search starts from recomputing everything rather than from the
    # baselines, so this test depends on the exact solver alone.
    options = SolverOptions(time_limit=5, workers=2, hint=recompute_all(problem))
    try:
        return solve(problem, budget, name, options)
    except BudgetError as e:
        return solve(problem, e.smallest, name, options)


def save_all_peak(problem: Problem) -> int:
    return simulate(problem, save_all(problem)).peak


def fresh_inputs(inputs):
    return tuple(x.detach().clone().requires_grad_(x.requires_grad)
                 if isinstance(x, torch.Tensor) else x for x in inputs)


def run_both(name: str, schedule):
    """One measured planned step and one eager step from the same weights and seed."""
    model, inputs, problem = planned(name)
    eager_model, plan_model = copy.deepcopy(model), copy.deepcopy(model)
    eager_inputs, plan_inputs = fresh_inputs(inputs), fresh_inputs(inputs)
    module = planned_module(plan_model, problem, schedule)
    torch.manual_seed(1234)
    measured = measure_step(module, plan_inputs)
    torch.manual_seed(1234)
    eager_loss = default_loss(eager_model(*eager_inputs))
    eager_loss.backward()
    return (eager_model, eager_inputs, eager_loss.item()), (plan_model, plan_inputs, measured,
                                                            module)


def assert_grads_equal(eager_model, plan_model, eager_inputs, plan_inputs):
    pairs = list(zip(eager_model.named_parameters(), plan_model.named_parameters()))
    pairs += [((f"input {i}", a), (f"input {i}", b))
              for i, (a, b) in enumerate(zip(eager_inputs, plan_inputs))
              if isinstance(a, torch.Tensor) and a.requires_grad]
    assert pairs
    for (name, a), (_, b) in pairs:
        if a.grad is None:
            assert b.grad is None, name
            continue
        assert b.grad is not None, name
        scale = max(a.grad.abs().max().item(), 1e-30)
        assert (a.grad - b.grad).abs().max().item() <= 1e-6 * scale, name


def assert_runs_schedule(problem: Problem, schedule, module):
    """The forward hands over exactly the saved ops, and the backward runs the simulator's step
    order: every backward op and recomputation, in that order, and nothing else."""
    part = module.partition
    assert set(part.saved) == {problem.ops[i].name for i in schedule.saved}
    assert set(part.recomputed) == {problem.ops[i].name for i in schedule.recomputed}
    outputs = list(part.forward.graph.output_node().args[0])[part.num_fwd_outputs:]
    handed = [*part.saved, *part.saved_inputs, *part.saved_symints]
    assert sorted(n.name for n in outputs) == sorted(handed)
    backward_inputs = [n.name for n in part.backward.graph.nodes if n.op == "placeholder"]
    assert sorted(backward_inputs[:len(handed)]) == sorted(handed)
    ran = [n.name for n in part.backward.graph.nodes if n.op == "call_function"
           and n.meta.get("remat", {}).get("role") != "rebuilt view"]
    expected = [problem.ops[i].name for i, kind in step_order(problem, schedule)
                if kind is not StepKind.FORWARD]
    assert ran == expected
    roles = [n.name for n in part.backward.graph.nodes
             if n.meta.get("remat", {}).get("role") == RECOMPUTE]
    assert sorted(roles) == sorted(part.recomputed)


def check(name: str, schedule):
    model, inputs, problem = planned(name)
    (eager_model, eager_inputs, eager_loss), (plan_model, plan_inputs, measured, module) = \
        run_both(name, schedule)
    assert measured.forward_calls == 1 and measured.backward_calls == 1
    assert measured.loss == eager_loss
    assert_grads_equal(eager_model, plan_model, eager_inputs, plan_inputs)
    for a, b in zip(eager_model.buffers(), plan_model.buffers()):
        assert torch.equal(a, b)
    predicted = simulate(problem, schedule).peak
    assert abs(measured.peak - predicted) <= max(0.05 * predicted, MiB), (measured.peak, predicted)
    if schedule.budget is not None:
        assert measured.peak <= schedule.budget
    assert_runs_schedule(problem, schedule, module)
    return measured


FAST = ["gpt", "mlp", "transformer_encoder"]
SLOW = ["resnet", "unet"]


@pytest.mark.parametrize("name", FAST + [pytest.param(n, marks=pytest.mark.slow) for n in SLOW])
def test_save_all_and_recompute_all_match_eager_and_simulator(name):
    _, _, problem = planned(name)
    check(name, save_all(problem))
    heavy = recompute_all(problem)
    assert heavy.recomputed
    check(name, heavy)


@pytest.mark.parametrize("name,strategy_name,fraction", [
    ("gpt", "checkpoint_blocks", 0.9),
    ("gpt", "optimal", 0.8),
    ("mlp", "optimal", 0.9),
    pytest.param("resnet", "optimal", 0.7, marks=pytest.mark.slow),
])
def test_solver_schedules_match_eager_and_fit_the_budget(name, strategy_name, fraction):
    _, _, problem = planned(name)
    schedule = strategy(problem, strategy_name, fraction)
    assert schedule.budget is not None
    check(name, schedule)


@pytest.mark.slow
def test_gpt2_from_transformers():
    _, _, problem = planned("gpt2_hf")
    check("gpt2_hf", save_all(problem))
    check("gpt2_hf", recompute_all(problem))


@pytest.mark.parametrize("name", ["gpt", pytest.param("resnet", marks=pytest.mark.slow)])
def test_five_optimizer_steps_match_eager(name):
    """Dropout (gpt) draws the same masks, BatchNorm (resnet) updates the same statistics."""
    model, inputs, problem = planned(name)
    eager_model, plan_model = copy.deepcopy(model), copy.deepcopy(model)
    module = planned_module(plan_model, problem, recompute_all(problem))
    runs = []
    steps = ((eager_model, lambda x: default_loss(eager_model(*x))),
             (plan_model, lambda x: module(*x)))
    for m, step in steps:
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        torch.manual_seed(7)
        losses = []
        for _ in range(5):
            opt.zero_grad()
            loss = step(fresh_inputs(inputs))
            loss.backward()
            opt.step()
            losses.append(loss.item())
        runs.append(losses)
    assert runs[0] == runs[1]
    for (n, a), b in zip(eager_model.state_dict().items(), plan_model.state_dict().values()):
        assert torch.allclose(a, b, rtol=0, atol=1e-6), n


def test_tied_weights_share_one_gradient():
    model, inputs, problem = planned("gpt")
    assert model.wte.weight is model.lm_head.weight
    (eager_model, _, _), (plan_model, _, _, _) = run_both("gpt", recompute_all(problem))
    assert plan_model.wte.weight is plan_model.lm_head.weight
    assert torch.equal(eager_model.lm_head.weight.grad, plan_model.lm_head.weight.grad)


class InPlace(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(64, 64), nn.Linear(64, 64)

    def forward(self, x, target):
        h = self.a(x)
        h.relu_()
        y = self.b(h)
        y += h
        y.add_(1.0)
        z = torch.tanh(y) * 2
        z.mul_(3)
        return F.mse_loss(z, target)


def test_in_place_ops_in_the_model():
    torch.manual_seed(0)
    model = InPlace()
    inputs = (torch.randn(32, 64, requires_grad=True), torch.randn(32, 64))
    problem = lower(capture(model, inputs))
    for schedule in (save_all(problem), recompute_all(problem)):
        eager, plan = copy.deepcopy(model), copy.deepcopy(model)
        xe, xp = fresh_inputs(inputs), fresh_inputs(inputs)
        eager(*xe).backward()
        module = planned_module(plan, problem, schedule)
        measured = measure_step(module, xp)
        assert_grads_equal(eager, plan, xe, xp)
        assert abs(measured.peak - simulate(problem, schedule).peak) <= MiB


def test_a_plan_for_another_graph_is_refused():
    _, _, problem = planned("mlp")
    other, other_inputs = models.mlp(batch=64)
    with pytest.raises(RematError, match="does not match"):
        planned_module(other, problem, save_all(problem))(*other_inputs)
    gpt, gpt_inputs = models.gpt()
    with pytest.raises(RematError, match="does not match"):
        planned_module(gpt, problem, save_all(problem))(*gpt_inputs)


def _forget_reason(problem: Problem, reason: Reason) -> Problem:
    ops = [replace(op, not_recomputable=None) if op.not_recomputable is reason else op
           for op in problem.ops]
    return Problem(tuple(ops), name=problem.name, source=problem.source)


def test_generator_snapshots_are_never_recomputed():
    """Even when a problem forgets that a snapshot of the generator can only be taken where the
    forward draws, the rewrite refuses to take it again in the backward."""
    model, inputs, problem = planned("gpt")
    lying = _forget_reason(problem, Reason.RANDOM)
    random_ops = [i for i, op in enumerate(problem.ops) if op.not_recomputable is Reason.RANDOM]
    assert random_ops
    schedule = make_schedule(lying, drop_unneeded(lying, recomputable(lying)))
    assert schedule.recomputed & set(random_ops)
    with pytest.raises(RematError, match="random"):
        planned_module(copy.deepcopy(model), lying, schedule)(*inputs)


def dropouts_recomputed(problem: Problem):
    """The schedule that recomputes every dropout (and what its outputs need), saving the rest."""
    drops = [i for i, op in enumerate(problem.ops)
             if op.target == "aten.native_dropout.default" and i < problem.num_forward]
    assert drops and all(problem.ops[i].not_recomputable is None for i in drops)
    outputs = {g for d in drops for g in problem.users[d] if g < problem.num_forward}
    return make_schedule(problem, drop_unneeded(problem, set(drops) | outputs)), drops


def test_recomputed_dropout_replays_the_forward_masks():
    """A recomputed dropout draws from the snapshot its forward took: gradients bitwise equal to
    eager's, and the generator ends the step where eager's does (the next step draws the same)."""
    _, _, problem = planned("gpt")
    schedule, drops = dropouts_recomputed(problem)
    assert set(drops) <= schedule.recomputed
    snapshots = {problem.ops[d].inputs[0] for d in drops}
    assert snapshots <= schedule.saved
    (eager_model, eager_inputs, eager_loss), (plan_model, plan_inputs, measured, module) = \
        run_both("gpt", schedule)
    assert measured.loss == eager_loss
    assert_grads_equal(eager_model, plan_model, eager_inputs, plan_inputs)
    replays = [n for n in module.partition.backward.graph.nodes
               if getattr(n.target, "replay", False)]
    assert len(replays) == len(drops)
    assert measured.peak == simulate(problem, schedule).peak
    # Another step of each: the planned one must leave the generator where eager leaves it.
    torch.manual_seed(99)
    measure_step(module, fresh_inputs(plan_inputs))
    after_plan = torch.rand(4)
    torch.manual_seed(99)
    default_loss(eager_model(*fresh_inputs(eager_inputs))).backward()
    assert torch.equal(after_plan, torch.rand(4))


def test_batchnorm_statistics_cost_what_they_cost_eager():
    """The step copies BatchNorm's new running statistics into the buffers as the forward ends,
    and the backward never reads them: saving everything, the planned step holds no more than
    eager does, and the simulator predicts it to the byte."""
    from remat.fx_passes.measuring.allocator import step_peak

    model, inputs, problem = planned("resnet")
    assert any(op.forward_output for op in problem.ops)
    schedule = save_all(problem)
    measured = check("resnet", schedule)
    assert measured.peak == simulate(problem, schedule).peak
    eager = copy.deepcopy(model)
    eager_inputs = fresh_inputs(inputs)
    # Both by the allocator, kernel scratch included.
    eager_peak, _ = step_peak(lambda: default_loss(eager(*eager_inputs)),
                              lambda loss, seed: loss.backward(seed))
    assert measured.peak <= eager_peak


def test_ops_reading_mutated_inputs_are_never_recomputed():
    """BatchNorm's running statistics change after the forward: recomputing batch norm in the
    backward would read the new ones (PyTorch's own partitioner fails here)."""
    model, inputs, problem = planned("resnet")
    lying = _forget_reason(problem, Reason.MUTATION)
    schedule = make_schedule(lying, drop_unneeded(lying, recomputable(lying)))
    with pytest.raises(RematError, match="overwrites"):
        planned_module(copy.deepcopy(model), lying, schedule)(*inputs)


def test_views_are_rebuilt_not_saved():
    _, _, problem = planned("gpt")
    schedule = recompute_all(problem)
    assert all(problem.ops[i].kind is not Kind.VIEW for i in schedule.saved)
    (_, _, _), (_, _, _, module) = run_both("gpt", schedule)
    rebuilt = [n for n in module.partition.backward.graph.nodes
               if n.meta.get("remat", {}).get("role") == "rebuilt view"]
    assert rebuilt


@pytest.mark.parametrize("which", ["save_all", "recompute_all"])
def test_live_bytes_follow_the_simulated_timeline_op_by_op(which):
    """Not only the peak: after every op of the step the live bytes equal the simulator's, so
    the boxed backward frees each saved tensor at its last use, as the execution model says."""
    from remat.fx_passes.measuring.memory_tracker import MemoryTracker

    model, inputs, problem = planned("mlp")
    schedule = save_all(problem) if which == "save_all" else recompute_all(problem)
    module = planned_module(copy.deepcopy(model), problem, schedule)
    tracker = MemoryTracker(record=True)
    with module.instrument(tracker):
        module(*fresh_inputs(inputs)).backward()
    measured = iter(tracker.timeline)
    compared = 0
    # The loss's size counts the backward's seed (lower), which autograd makes outside the
    # graphs: the tracker does not see it.
    seeds, unseen = problem.source["seeds"], 0
    for step in simulate(problem, schedule).steps:
        op = problem.ops[step.op]
        unseen += seeds.get(op.name, 0)
        if op.target == str(operator.getitem):  # a Python getitem dispatches nothing
            continue
        func, live = next(measured)
        while func != op.target:  # views the backward rebuilds are not steps of their own
            func, live = next(measured)
        assert live == step.live - op.temp - unseen, (op.name, live, step.live)
        compared += 1
    assert compared > len(problem.ops) // 2
