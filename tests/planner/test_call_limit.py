"""A time limit left to the problem's size is the whole planning call's: `remat.optimize`
starts counting before the capture (`SolverOptions.started`), and the solver gets what is left
(`remat.solvers.core.options.limit_left`). Clocks are injected: nothing here reads the wall
clock."""
from __future__ import annotations

import pytest

import remat.planner.optimize as optimize_module
from remat.planner.optimize import optimize
from remat.planner.job.training import Training
from remat.solvers import SolverOptions
from remat.solvers.core.options import SIZED_AFTER_SHARE, SIZED_LEAST_SHARE, sized_limit
from tests.models import GPTConfig, gpt


def test_a_sized_limit_counts_the_time_the_call_spent():
    whole = sized_limit(5000)
    assert whole == 15.0  # 10 s + a second per 1,000 ops
    late = SolverOptions(started=95.0, clock=lambda: 100.0)
    assert late.by_size(5000).time_limit == pytest.approx((1 - SIZED_AFTER_SHARE) * whole - 5)
    # A capture that took longer than the limit still leaves the solver its least share.
    slow = SolverOptions(started=0.0, clock=lambda: 100.0)
    assert slow.by_size(5000).time_limit == pytest.approx(SIZED_LEAST_SHARE * whole)
    # A given limit is the solver's; deterministic mode keeps the whole sized limit (its plan
    # must not depend on how long the capture took); with no start, nothing is counted.
    assert SolverOptions(started=0.0, clock=lambda: 100.0, time_limit=7).by_size(5000) \
        .time_limit == 7
    assert SolverOptions(started=0.0, clock=lambda: 100.0, deterministic=True).by_size(5000) \
        .time_limit == whole
    assert SolverOptions().by_size(5000).time_limit == whole


def a_capture_of_4_seconds(monkeypatch):
    """An injected clock (a list holding now), on which `remat.optimize`'s capture "takes" 4 s
    and which stands still while the solver runs; a tiny GPT and its inputs."""
    now = [1000.0]
    real_prepare = optimize_module.prepare

    def slow_prepare(*args, **kwargs):
        now[0] += 4.0
        return real_prepare(*args, **kwargs)

    monkeypatch.setattr(optimize_module, "prepare", slow_prepare)
    model, inputs = gpt(GPTConfig(block_size=32, vocab_size=128, n_layer=2, n_head=2,
                                  n_embd=32, dropout=0.0), batch=2)
    return now, model, inputs


def test_optimize_counts_its_capture_in_the_default_limit(monkeypatch):
    """The capture "takes" 4 s on the injected clock, which stands still while the solver runs:
    the solve's limit is the call's less those 4 s, and the report says so."""
    now, model, inputs = a_capture_of_4_seconds(monkeypatch)
    plan = optimize(model, activation_budget="1GB", example_inputs=inputs,
                    training=Training(reserve=0, fragmentation=0.0),
                    solver_options=SolverOptions(clock=lambda: now[0], workers=2))
    whole = sized_limit(len(plan.problem))
    info = plan.schedule.info
    assert info["spent_before_solve"] == pytest.approx(4.0)
    assert info["time_limit"] == pytest.approx((1 - SIZED_AFTER_SHARE) * whole - 4.0)
    assert info["limits"] == (f"chosen by problem size: {whole:g} s for the whole call, 4.0 s "
                              "of it spent before the solve")
    assert f"({info['limits']})" in plan.report().render()
    assert plan.solver_options.started is None  # a later re-plan counts from its own start


def test_an_eager_plan_counts_its_capture_and_states_its_limits(monkeypatch):
    """execution="eager" as compiled: the capture's 4 s (injected clock) are the call's, and
    the report states the limit the eager search ran under and who chose it."""
    now, model, inputs = a_capture_of_4_seconds(monkeypatch)
    plan = optimize(model, activation_budget="1GB", example_inputs=inputs, execution="eager",
                    training=Training(reserve=0, fragmentation=0.0),
                    solver_options=SolverOptions(clock=lambda: now[0], workers=2))
    whole = sized_limit(len(plan.eager_problem))
    info = plan.schedule.info
    assert info["spent_before_solve"] == pytest.approx(4.0)
    assert info["time_limit"] == pytest.approx((1 - SIZED_AFTER_SHARE) * whole - 4.0)
    assert info["limits"].startswith(f"chosen by problem size: {whole:g} s for the whole call")
    assert f"({info['limits']})" in plan.report().render()
    # A given limit is stated as given and is the solver's alone.
    given = optimize(model, activation_budget="1GB", example_inputs=inputs, execution="eager",
                     training=Training(reserve=0, fragmentation=0.0),
                     solver_options=SolverOptions(time_limit=5.0, relative_gap=0.0,
                                                  clock=lambda: now[0], workers=2))
    assert given.schedule.info["time_limit"] == 5.0
    assert given.schedule.info["limits"] == "given"
    assert "spent_before_solve" not in given.schedule.info
    assert plan.solver_options.started is None  # a later re-plan counts from its own start
