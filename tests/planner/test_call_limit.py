"""The default time limit is the solver's own: `remat.optimize`'s capture, profiling and
lowering do not count against it, and the report states what each phase took. Clocks are
injected: the capture "takes" 4 s on the solver's clock; nothing here reads the wall clock."""
from __future__ import annotations

import dataclasses

import pytest

import remat.planner.optimize as optimize_module
from remat.planner.optimize import optimize
from remat.planner.job.training import Training
from remat.solvers import SolverOptions
from remat.solvers.core.options import sized_limit
from tests.models import GPTConfig, gpt
from tests.planner.small_gpt import model_inputs, prepared  # noqa: F401 (fixtures)

# The preparation's phases as the injected capture reports them (the solve's is measured).
PHASES = (("capture", 4.0), ("profile", 0.5), ("lower", 0.3))


def a_capture_of_4_seconds(monkeypatch):
    """An injected clock (a list holding now), on which `remat.optimize`'s capture "takes" 4 s
    and which stands still while the solver runs; the preparation reports PHASES; a tiny GPT
    and its inputs."""
    now = [1000.0]
    real_prepare = optimize_module.prepare

    def slow_prepare(*args, **kwargs):
        now[0] += 4.0
        return dataclasses.replace(real_prepare(*args, **kwargs), phases=PHASES)

    monkeypatch.setattr(optimize_module, "prepare", slow_prepare)
    model, inputs = gpt(GPTConfig(block_size=32, vocab_size=128, n_layer=2, n_head=2,
                                  n_embd=32, dropout=0.0), batch=2)
    return now, model, inputs


@pytest.mark.parametrize("execution", ["compiled", "eager"])
def test_the_default_limit_is_the_solvers_own(monkeypatch, execution):
    """The capture's 4 s on the solver's clock leave the limit chosen by the problem's size
    whole, in both modes; the report states it as chosen, and each phase's seconds."""
    now, model, inputs = a_capture_of_4_seconds(monkeypatch)
    plan = optimize(model, activation_budget="1GB", example_inputs=inputs,
                    execution=execution, training=Training(reserve=0, fragmentation=0.0),
                    solver_options=SolverOptions(clock=lambda: now[0], workers=2))
    problem = plan.eager_problem if execution == "eager" else plan.problem
    info = plan.schedule.info
    assert info["time_limit"] == sized_limit(len(problem))
    assert info["limits"] == "chosen by problem size"
    assert "spent_before_solve" not in info
    names = [name for name, _ in plan.phases]
    assert names == ["capture", "profile", "lower",
                     *(["probe"] if execution == "eager" else []), "solve"]
    assert plan.phases[:3] == PHASES
    report = plan.report()
    assert report.solver.phases == plan.phases
    text = report.render()
    assert "(chosen by problem size)" in text
    assert "time by phase" in text and "capture 4.0 s, profile 0.5 s, lower 0.3 s" in text
    assert f"({sum(s for _, s in plan.phases):.1f} s in all)" in text


def test_a_given_limit_is_stated_as_given(monkeypatch):
    now, model, inputs = a_capture_of_4_seconds(monkeypatch)
    given = optimize(model, activation_budget="1GB", example_inputs=inputs, execution="eager",
                     training=Training(reserve=0, fragmentation=0.0),
                     solver_options=SolverOptions(time_limit=5.0, relative_gap=0.0,
                                                  clock=lambda: now[0], workers=2))
    assert given.schedule.info["time_limit"] == 5.0
    assert given.schedule.info["limits"] == "given"


def test_sized_limits_do_not_depend_on_the_call():
    whole = sized_limit(5000)
    assert whole == 15.0  # 10 s + a second per 1,000 ops
    assert SolverOptions().by_size(5000).time_limit == whole
    assert SolverOptions(deterministic=True).by_size(5000).time_limit == whole
    assert SolverOptions(time_limit=7).by_size(5000).time_limit == 7


def test_prepare_records_its_phases(prepared):
    """Each phase of the preparation, in order, within the preparation's own time."""
    assert [name for name, _ in prepared.phases] == ["capture", "profile", "lower"]
    assert all(seconds >= 0 for _, seconds in prepared.phases)
    assert sum(seconds for _, seconds in prepared.phases) <= prepared.prepare_time
