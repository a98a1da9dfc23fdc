"""The rewrite runs the richer execution model: a value recomputed within the forward (a long
skip connection), recomputed a second time in the backward, or offloaded to host memory and
loaded back. Judged against plain eager PyTorch (gradients) and the allocator (peak), never
against remat's own tracker.

Schedules are drawn at random (seeded) from the richer space of a small model with a long skip,
so that forward recomputations, second backward recomputations, views of a recomputed base
(backward `detach` views among them) and offloads all occur; `make_schedule` refuses invalid
draws, which are skipped."""
from __future__ import annotations

import copy
import dataclasses
import random

import pytest
import torch
import torch.nn as nn

from remat.fx_passes.tracing.capture import capture, default_loss
from remat.fx_passes.lowering.lower import lower
from remat.fx_passes.compiled.measure_step import measure_step
from remat.fx_passes.compiled.planned import planned_module
from remat.solvers.core.problem import Kind, Problem
from remat.solvers.core.schedule import Schedule, recomputable
from remat.solvers.timeline.evaluate import make_schedule
from remat.solvers.timeline.simulate import StepKind, simulate, step_order


class LongSkip(nn.Module):
    """Five linear layers; the first layer's output is read again by the last (a long skip),
    and a middle product reads two layers back."""

    def __init__(self, width: int = 64):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(5))

    def forward(self, x):
        h0 = torch.relu(self.layers[0](x))
        h1 = torch.tanh(self.layers[1](h0))
        h2 = torch.relu(self.layers[2](h1))
        h3 = torch.sigmoid(self.layers[3](h2 * h1))
        out = self.layers[4](h3 + h0)
        return (out * out).mean()


@pytest.fixture(scope="module")
def step():
    torch.manual_seed(0)
    model = LongSkip()
    x = torch.randn(128, 64)
    problem = dataclasses.replace(lower(capture(model, (x.clone().requires_grad_(),))),
                                  host_bandwidth=1e9)
    return model, x, problem


def _draw(problem: Problem, rng: random.Random, *, offload: bool) -> Schedule | None:
    """A random schedule of the richer space, or None where the draw cannot run."""
    nf = problem.num_forward
    forward = [v for v in range(nf) if problem.ops[v].kind is Kind.TENSOR and problem.ops[v].size
               and v not in problem.pinned and problem.ops[v].not_recomputable is None]
    recomputed = [v for v in recomputable(problem) if rng.random() < 0.4]
    again: dict[int, tuple[int, ...]] = {}
    for v in rng.sample(forward, 3):
        positions = [p for p in range(v + 1, nf) if rng.random() < 0.2]
        if positions:
            again[v] = tuple(positions[:2])
    try:
        base = make_schedule(problem, recomputed)
        for v, b in base.recompute_at.items():
            later = [p for p in range(b + 1, len(problem.ops)) if rng.random() < 0.2]
            if later and problem.ops[v].kind is Kind.TENSOR and rng.random() < 0.5:
                again[v] = tuple(sorted({*again.get(v, ()), later[0]}))
        offloads = {v: nf + rng.randrange(3) for v in sorted(base.saved)
                    if offload and problem.ops[v].kind is Kind.TENSOR and problem.ops[v].size
                    and rng.random() < 0.3}
        return make_schedule(problem, recomputed, recompute_at=base.recompute_at, again=again,
                             offload_at=offloads)
    except ValueError:
        return None


def _run(model, x, problem, schedule):
    eager_model, plan_model = copy.deepcopy(model), copy.deepcopy(model)
    eager_x, plan_x = x.clone().requires_grad_(), x.clone().requires_grad_()
    module = planned_module(plan_model, problem, schedule)
    measured = measure_step(module, (plan_x,))
    default_loss(eager_model(eager_x)).backward()
    for (name, a), b in zip(eager_model.named_parameters(), plan_model.parameters()):
        assert torch.allclose(a.grad, b.grad, rtol=1e-6, atol=0), name
    assert torch.allclose(eager_x.grad, plan_x.grad, rtol=1e-6, atol=0)
    return measured, module


def _schedules(problem, count, *, offload, seed):
    rng = random.Random(seed)
    found = []
    while len(found) < count:
        schedule = _draw(problem, rng, offload=offload)
        if schedule is not None and schedule.again and (schedule.offload_at or not offload):
            found.append(schedule)
    return found


def test_recomputing_again_matches_eager_and_the_allocator(step):
    model, x, problem = step
    nf = problem.num_forward
    forward_copies = backward_copies = 0
    for schedule in _schedules(problem, 4, offload=False, seed=0):
        measured, module = _run(model, x, problem, schedule)
        assert measured.peak == simulate(problem, schedule).peak  # the allocator, to the byte
        part = module.partition
        in_forward = [problem.ops[v].name for v, ps in schedule.again.items()
                      for p in ps if p < nf]
        assert sorted(part.recomputed_in_forward) == sorted(in_forward)
        again_backward = [problem.ops[v].name for v, ps in schedule.again.items()
                          for p in ps if p >= nf]
        assert sorted(part.recomputed) == sorted(
            [problem.ops[v].name for v in schedule.recomputed] + again_backward)
        forward_copies += len(in_forward)
        backward_copies += len(again_backward)
    assert forward_copies and backward_copies  # both kinds were exercised


def test_a_value_recomputed_twice_in_the_backward(step):
    """A hand-picked schedule: the first layer's output (read by the long skip's backward and by
    the first layers' backward) is recomputed twice in the backward: once for the last layer's
    backward, once more at the end. The backward graph runs it twice; eager gradients; the
    allocator's peak equals the simulated one."""
    model, x, problem = step
    h0 = problem.index("relu")
    base = make_schedule(problem, [h0])
    first = base.recompute_at[h0]
    readers = sorted(r for r in problem.storage_readers[h0] if r >= problem.num_forward)
    later = [r for r in readers if r > first and any(q <= r for q in readers if q > first)]
    schedule = make_schedule(problem, [h0], recompute_at=base.recompute_at,
                             again={h0: (later[-1],)})
    order = [i for i, kind in step_order(problem, schedule) if kind is StepKind.RECOMPUTE]
    assert order.count(h0) == 2
    measured, module = _run(model, x, problem, schedule)
    assert module.partition.recomputed.count("relu") == 2
    assert measured.peak == simulate(problem, schedule).peak
    assert schedule.cost == pytest.approx(2 * problem.ops[h0].cost)


def test_offloaded_values_match_eager(step):
    """On the CPU the host buffers are CPU memory too, allocated ahead (when the graphs are
    made, inside the first step) and reused: the first step's allocator peak is the simulated
    device peak plus every offloaded byte, the next step's the simulated peak exactly (the
    device copies held while their copies to host run, as the timeline says)."""
    model, x, problem = step
    for schedule in _schedules(problem, 2, offload=True, seed=1):
        measured, module = _run(model, x, problem, schedule)
        host = sum(problem.ops[v].size for v in schedule.offload_at)
        assert measured.peak == schedule.peak + host
        assert module.partition.host_pool.nbytes() == host
        again = measure_step(module, (x.clone().requires_grad_(),))
        assert again.peak == schedule.peak
        assert set(module.partition.offloaded) == {problem.ops[v].name
                                                   for v in schedule.offload_at}
        assert schedule.transfer_time == pytest.approx(2 * host / problem.host_bandwidth)


def test_the_report_shows_offloaded_bytes_and_further_recomputations(step):
    from remat.planner.plans.report import _price_table, price

    _, _, problem = step
    schedule = _schedules(problem, 1, offload=True, seed=1)[0]
    p = price(problem, schedule, device="H100 SXM", peak_flops=1e15, time_source="predicted")
    host = sum(problem.ops[v].size for v in schedule.offload_at)
    assert p.offloaded_bytes == host and p.transfer_time == pytest.approx(2 * host / 1e9)
    assert p.recomputations == schedule.recomputations > len(schedule.recomputed)
    assert p.recompute_time == pytest.approx(schedule.cost - schedule.exposed_time)
    assert p.hidden_time == pytest.approx(schedule.transfer_time - schedule.exposed_time)
    table = _price_table(p)
    assert "offloaded to host" in table and "recomputations" in table and "hidden" in table


def test_optimize_with_offload_plans_and_runs_it(step):
    """`optimize(offload=True)` at the single model's smallest activation peak: the plan keeps
    saved values in host memory (a fast host link makes that cheaper than recomputing), runs
    with eager's gradients, and the allocator sees the simulated device peak once the host
    buffers are allocated (CPU memory here)."""
    import remat
    from remat.fx_passes.measuring.allocator import step_peak
    from remat.solvers import SolverOptions

    model, x, _ = step
    with pytest.raises(remat.BudgetError) as error:
        remat.optimize(model, activation_budget=0, example_inputs=(x,),
                       solver_options=SolverOptions(time_limit=5, model="single"))
    plan = remat.optimize(model, activation_budget=error.value.smallest, example_inputs=(x,),
                          offload=True, target="gh200", solver_options=SolverOptions(time_limit=10))
    schedule = plan.schedule
    assert schedule.offload_at and schedule.info["model"] == "rich"
    assert schedule.transfer_time > 0 and plan.report().price.offloaded_bytes > 0
    eager_model, plan_x, eager_x = copy.deepcopy(model), x.clone(), x.clone()
    plan.module(plan_x).backward()  # compile outside the measurement
    model.zero_grad(set_to_none=True)
    peak, _ = step_peak(lambda: plan.module(plan_x), lambda out, seed: out.backward(seed))
    default_loss(eager_model(eager_x)).backward()
    for (name, a), b in zip(eager_model.named_parameters(), model.parameters()):
        assert torch.allclose(a.grad, b.grad, rtol=1e-6, atol=0), name
    assert peak == schedule.peak  # host buffers allocated ahead, in the first call
