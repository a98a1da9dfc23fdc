"""The exact eager search keeps to its deadline in the stages that are Python work or CP-SAT's
loading of the model, not only in CP-SAT's search: the model's construction stops when the time
passes, and a CP-SAT stage starts only with time left to load the model (a share of its build
time). The clock is injected: nothing here reads the wall clock."""
from __future__ import annotations

import pytest

import remat.solvers.eager.least as eager_least
import remat.solvers.eager.search as eager_search
import remat.solvers.core.deadline as deadline_module
from remat.solvers.eager.search import (SOLVE_SETUP_SHARE, least_eager_peak,
                                              optimal_eager)
from remat.solvers.core.deadline import Deadline
from remat.solvers.timeline.eager import eager_schedule
from tests.oracles.eager_brute import budget_between
from remat.solvers.core.options import SolverOptions
from remat.solvers.core.schedule import Status
from tests.synthetic.eager import random_eager

OPTIONS = SolverOptions(time_limit=20, workers=2, cost_resolution=1e-9)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def slow_build(monkeypatch, clock: FakeClock, *, before: float = 0.0, after: float = 0.0):
    """The eager model's construction "takes" `before` seconds at its start (its loops then
    find the time spent) and `after` at its end; every loop looks at the clock each turn."""
    monkeypatch.setattr(deadline_module, "TICK_EVERY", 1)
    real = eager_search.EagerModel

    def building(*args, **kwargs):
        clock.now += before
        model = real(*args, **kwargs)
        clock.now += after
        return model

    monkeypatch.setattr(eager_search, "EagerModel", building)
    monkeypatch.setattr(eager_least, "EagerModel", building)  # the least-peak search's


def a_problem_with_a_hint():
    problem, blocks = random_eager(11, max_forward=11, max_backward=8, max_cacheable=11)
    _, budget = budget_between(problem, blocks, 0.5)
    hint = tuple(sorted(blocks.cacheable))
    if eager_schedule(problem, blocks, hint).peak > budget:
        hint = ()
    assert eager_schedule(problem, blocks, hint).peak <= budget
    return problem, blocks, budget, hint


def test_a_build_that_runs_out_of_time_returns_the_hint(monkeypatch):
    clock = FakeClock()
    slow_build(monkeypatch, clock, before=100.0)
    problem, blocks, budget, hint = a_problem_with_a_hint()
    deadline = Deadline(10.0, clock=clock)
    found = optimal_eager(problem, blocks, budget, OPTIONS, hint=hint, deadline=deadline)
    assert found.info["cached"] == eager_schedule(problem, blocks, hint).info["cached"]
    assert found.peak <= budget and found.bound == 0.0
    assert found.status is Status.FEASIBLE or found.cost == 0
    assert deadline.stopped == ("eager: building the model", "no time left")
    assert found.info["how"] == "no time to build"
    # The least-peak search likewise returns its start, with nothing proven.
    least, floor = least_eager_peak(problem, blocks, OPTIONS,
                                    deadline=Deadline(10.0, clock=clock))
    assert least.info["cached"] == eager_schedule(problem, blocks, ()).info["cached"]
    assert floor == 0


@pytest.mark.parametrize("build_seconds, searched", [(8.0, False), (1.0, True)])
def test_a_cp_sat_stage_starts_only_with_time_to_load_the_model(monkeypatch, build_seconds,
                                                                searched):
    """The build "takes" 8 s of 10: the 2 s left (less the least-peak reserve) are under a
    quarter of the build's 8, so neither the slot bound nor the least-cost search starts, and
    the hint comes back. At 1 s of build both run."""
    clock = FakeClock()
    slow_build(monkeypatch, clock, after=build_seconds)
    problem, blocks, budget, hint = a_problem_with_a_hint()
    deadline = Deadline(10.0, clock=clock)
    found = optimal_eager(problem, blocks, budget, OPTIONS, hint=hint, deadline=deadline)
    assert found.peak <= budget
    stages = [stage for stage, _ in found.info["stages"]]
    if searched:
        assert SOLVE_SETUP_SHARE * build_seconds < 10.0 - build_seconds
        assert "eager: slot bound" in stages
        assert found.status is Status.OPTIMAL
    else:
        assert stages == ["eager: the model"]
        assert deadline.stopped == ("eager: least cost", "no time left to load the model")
        assert found.info["cached"] == eager_schedule(problem, blocks, hint).info["cached"]
