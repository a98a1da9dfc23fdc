"""`optimize(..., offload=True)` in both execution modes, judged by plain eager
PyTorch's gradients and the CPU allocator: the plan keeps values in host memory where their
transfers hide under the compute, within `Training(host_memory=...)`, runs with eager's
gradients, and its device peak is the simulated one (the host buffers, CPU memory here too, are
allocated in the first step and reused: measured from the second)."""
from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch

import remat
from examples.llama import LLAMA_TEST, tiny_llama
from remat.fx_passes.measuring.allocator import peak_and_result, step_peak
from remat.planner.job.training import Training
from remat.solvers import SolverOptions
from remat.solvers.timeline.overlap import host_bytes
from remat.solvers.timeline.evaluate import price

CONFIG = replace(LLAMA_TEST, seq=32, layers=4)
FAST = SolverOptions(time_limit=10)


@pytest.fixture(scope="module")
def llama():
    model, inputs = tiny_llama(CONFIG, batch=4)
    reference = copy.deepcopy(model)
    peak, loss = peak_and_result(lambda: _step(reference, inputs))
    return model, inputs, peak, loss, {n: p.grad for n, p in reference.named_parameters()}


def _step(model, inputs, seed=7):
    torch.manual_seed(seed)  # dropout is on: equal gradients need equal masks
    loss = model(*inputs)
    loss.backward()
    return float(loss.detach())


def _same_gradients(model, grads):
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[name], rtol=1e-5, atol=1e-7, msg=name)


def _problem(plan):
    """The problem the plan's schedule numbers."""
    return plan.eager_problem if plan.execution == "eager" else plan.problem


@pytest.fixture(scope="module")
def plans(llama):
    return {execution: _plan(llama, 0.6, execution) for execution in ("compiled", "eager")}


def _plan(llama, fraction, execution, host_memory=None):
    model, inputs, plain, _, _ = llama
    return remat.optimize(model, activation_budget=int(fraction * plain),
                          example_inputs=inputs, execution=execution, offload=True,
                          target="gh200", solver_options=FAST,
                          training=Training(host_memory=host_memory))


def test_compiled_offload_runs_with_eager_gradients_at_the_simulated_peak(llama, plans):
    model, inputs, _, plain_loss, grads = llama
    plan = plans["compiled"]
    schedule = plan.schedule
    assert schedule.offload_at, "a fast host link makes keeping values in host memory pay"
    assert schedule.cost == price(plan.problem, schedule)[0]
    mine = copy.deepcopy(model)
    module = plan.apply(mine)
    torch.manual_seed(7)
    module(*inputs).backward()  # compiles; the host buffers are made here
    pool = module.partition.host_pool
    assert pool.nbytes() == host_bytes(plan.problem, schedule)
    mine.zero_grad(set_to_none=True)
    torch.manual_seed(7)
    peak, loss = step_peak(lambda: module(*inputs), lambda out, seed: out.backward(seed))
    assert float(loss.detach()) == plain_loss
    _same_gradients(mine, grads)
    assert peak == plan.memory.simulated_peak == schedule.peak
    assert pool.allocated == len(schedule.offload_at)  # reused, none made on the fly


def test_eager_offload_runs_with_eager_gradients_at_the_simulated_peak(llama, plans):
    model, inputs, plain, plain_loss, grads = llama
    plan = plans["eager"]
    schedule = plan.schedule
    assert schedule.offload_at and plan.execution == "eager"
    assert set(schedule.info["offload"]) == set(schedule.offload_at)
    mine = plan.apply(copy.deepcopy(model))
    _step(mine, inputs)  # the host buffers are made in the first step
    mine.zero_grad(set_to_none=True)
    measured, loss = peak_and_result(lambda: _step(mine, inputs))
    assert loss == plain_loss
    _same_gradients(mine, grads)
    predicted = plan.memory.simulated_peak
    assert abs(measured - predicted) <= 0.01 * measured, (measured, predicted)
    assert measured < plain
    # The same budget without offload recomputes more.
    without = remat.optimize(model, activation_budget=int(0.6 * plain), example_inputs=inputs,
                             execution="eager", target="gh200", solver_options=FAST)
    assert schedule.cost < without.schedule.cost


@pytest.mark.parametrize("execution", ["compiled", "eager"])
def test_the_host_holds_no_more_than_host_memory(llama, plans, execution):
    """A host budget of the smallest offloaded value's bytes: at most that much is offloaded."""
    plan = plans[execution]
    sizes = sorted(_problem(plan).ops[v].size for v in plan.schedule.offload_at)
    assert len(sizes) > 1
    room = sizes[0]
    capped = _plan(llama, 0.6, execution, host_memory=room)
    assert host_bytes(_problem(capped), capped.schedule) <= room
    assert _problem(capped).host_capacity == room
    assert capped.training.host_memory == room


@pytest.mark.parametrize("execution", ["compiled", "eager"])
def test_the_report_says_what_is_offloaded_and_how_much_is_hidden(plans, execution):
    plan = plans[execution]
    report = plan.report()
    rows, price = report.offloaded, report.price
    assert len(rows) == len(plan.schedule.offload_at)
    assert sum(r.size for r in rows) == price.offloaded_bytes > 0
    assert price.transfer_time == pytest.approx(sum(r.transfer_time for r in rows))
    assert price.hidden_time == pytest.approx(price.transfer_time - price.exposed_time)
    assert sum(r.wait for r in rows) == pytest.approx(price.exposed_time, abs=1e-12)
    text = report.render()
    assert "Offloaded to host" in text and "hidden under compute" in text
    assert rows[0].name in text


@pytest.mark.parametrize("execution", ["compiled", "eager"])
def test_offload_plans_round_trip_through_plan_files(llama, plans, execution, tmp_path):
    """A saved offload plan loads onto the model with the same offloads, peak and cost, and
    (eager) the same block policies."""
    model, *_ = llama
    plan = plans[execution]
    plan.save(tmp_path / "plan.json")
    loaded = remat.load_plan(tmp_path / "plan.json", model)
    assert dict(loaded.schedule.offload_at) == dict(plan.schedule.offload_at)
    assert (loaded.schedule.peak, loaded.schedule.cost) == (plan.schedule.peak,
                                                             plan.schedule.cost)
    assert _problem(loaded).host_bandwidth == _problem(plan).host_bandwidth
    if execution == "eager":
        assert loaded.block_policies == plan.block_policies


def test_eager_offload_leaves_evaluation_calls_plain(llama, plans):
    """The offload hooks run inside a planned training call only: a call under no_grad, or in
    eval mode, runs the blocks plainly (nothing offloaded, no shape check), and the training
    step after it still offloads with eager's gradients."""
    model, inputs, _, plain_loss, grads = llama
    mine = plans["eager"].apply(copy.deepcopy(model))
    reference = copy.deepcopy(model)
    with torch.no_grad():
        torch.manual_seed(7)
        expected = float(reference(*inputs))
        torch.manual_seed(7)
        assert float(mine(*inputs)) == expected
    mine.eval()
    reference.eval()
    assert float(mine(*inputs).detach()) == float(reference(*inputs).detach())
    mine.train()
    mine.zero_grad(set_to_none=True)
    assert _step(mine, inputs) == plain_loss
    _same_gradients(mine, grads)


def test_offload_is_refused_for_a_range_of_shapes(llama):
    model, inputs, *_ = llama
    with pytest.raises(ValueError, match="fixed shapes"):
        remat.optimize(model, activation_budget=1, example_inputs=inputs, offload=True,
                       execution="eager", dynamic={"batch": (1, 4)})
