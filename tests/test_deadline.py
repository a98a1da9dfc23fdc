"""The solver's deadline: on a fake clock, what it allows, where a call stops, and that CP-SAT
stops when it passes. No assertion here reads the wall clock."""
from __future__ import annotations

import pytest
from ortools.sat.python import cp_model

from remat.solvers.deadline import Deadline, OutOfTime


class FakeClock:
    def __init__(self, now: float = 100.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_parts_never_end_after_the_whole_and_record_into_it():
    clock = FakeClock()
    deadline = Deadline(10.0, clock=clock)
    assert deadline.left() == 10.0 and deadline.share(0.25) == 2.5
    part = deadline.within(4.0)
    clock.now += 3.0
    assert part.left() == pytest.approx(1.0) and deadline.share(0.9) == pytest.approx(7.0)
    late = deadline.within(60.0)
    assert late.end == deadline.end
    deadline.enter("baselines")
    clock.now += 1.5
    assert part.expired() and not deadline.expired()
    assert not part.check("the relaxation")
    assert deadline.stopped == ("the relaxation", "no time left")
    with pytest.raises(OutOfTime):
        deadline.until(clock.now - 1).raise_if_expired("building the model")
    assert deadline.stopped[0] == "the relaxation"  # the first stage that ran out stays named
    assert deadline.stages == (("baselines", 3.0),)


def test_deterministic_mode_plans_on_charged_time_and_names_a_wall_cut():
    clock = FakeClock()
    deadline = Deadline(10.0, clock=clock, deterministic=True)
    clock.now += 8.0  # the machine is slow: the wall clock does not move the plan
    assert deadline.left() == 10.0
    deadline.charge(4.0)
    assert deadline.left() == 6.0 and deadline.wall_left() == 2.0
    deadline.enter("searching")
    clock.now += 2.0
    assert deadline.expired() and deadline.cut == "searching"


def _hard_model() -> cp_model.CpModel:
    model = cp_model.CpModel()
    xs = [model.NewIntVar(0, 50, f"x{i}") for i in range(40)]
    model.Add(sum((i % 7 + 3) * x for i, x in enumerate(xs)) <= 1999)
    model.AddAllDifferent(xs)
    model.Maximize(sum((i % 5 + 2) * x for i, x in enumerate(xs)))
    return model


def test_guard_stops_a_search_once_the_fake_clock_passes_the_deadline():
    clock = FakeClock()
    deadline = Deadline(5.0, clock=clock)
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1
    solver.parameters.max_time_in_seconds = 600.0  # only the watchdog can stop it

    class Tick(cp_model.CpSolverSolutionCallback):
        def on_solution_callback(self):
            clock.now += 1.0  # each solution found "takes" a second

    clock.now += 5.0  # spent before the search starts: the watchdog stops it at once
    with deadline.guard(solver):
        status = solver.Solve(_hard_model(), Tick())
    assert status in (cp_model.FEASIBLE, cp_model.UNKNOWN)  # stopped (600 s otherwise)
