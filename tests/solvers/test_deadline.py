"""The solver's deadline: on a fake clock, what it allows, where a call stops, and that CP-SAT
stops when it passes. No assertion here reads the wall clock."""
from __future__ import annotations

import pytest
from ortools.sat.python import cp_model

from remat.solvers.core.deadline import Deadline, OutOfTime


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
    """Planned on 5 deterministic seconds of a 10 s limit: the wall clock does not move the
    plan while the machine keeps within twice the plan's pace; past that, the time left is the
    wall clock's share and the call is marked cut, in the stage where it happened."""
    clock = FakeClock()
    deadline = Deadline(10.0, clock=clock, deterministic=True, planned=5.0)
    deadline.charge(2.0)
    clock.now += 4.0  # twice the plan's pace (4 s for 2), within the margin (1.25 s planned)
    assert deadline.left() == 3.0 and deadline.cut is None
    part = deadline.within(2.0)  # 2 planned seconds, 4 of the wall clock
    assert part.left() == 2.0
    deadline.enter("searching")
    clock.now += 3.5
    assert part.left() == pytest.approx(0.25)  # 0.5 s of wall left of its 4: a quarter
    assert deadline.cut == "searching" and deadline.wall_left() == 2.5
    clock.now += 2.5
    assert deadline.expired()


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


# --- Whole calls of `optimal` on a fake clock: what ran, and where it stopped.

import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import textwrap  # noqa: E402
from pathlib import Path  # noqa: E402

from remat.errors import BudgetError  # noqa: E402
from remat.solvers import SolverOptions, Strategy, make_schedule, solve  # noqa: E402
from remat.solvers.cpsat import driver, rich_search  # noqa: E402
from tests.synthetic.problems import transformer, transformer_ops, unet  # noqa: E402


def _stage_names(schedule) -> list[str]:
    return [stage for stage, _ in schedule.info["stages"]]


@pytest.mark.parametrize("deterministic", [False, True])
def test_a_stage_that_spends_the_time_ends_the_call_with_the_plan_so_far(monkeypatch,
                                                                         deterministic):
    """The relaxation "takes" 1,000 s of a 60 s limit: no later stage starts, the plan read so
    far comes back, and the result names the first stage that found no time."""
    clock = FakeClock()
    real = driver.relaxed_schedule

    def slow_relaxation(*args, **kwargs):
        found = real(*args, **kwargs)
        clock.now += 1000.0
        return found

    monkeypatch.setattr(driver, "relaxed_schedule", slow_relaxation)
    problem = transformer_ops(500)
    budget = make_schedule(problem, []).peak // 2
    options = SolverOptions(time_limit=60, relative_gap=0, model="single", clock=clock,
                            deterministic=deterministic)
    result = solve(problem, budget, Strategy.OPTIMAL, options)
    assert result.peak <= budget
    stages = _stage_names(result)
    assert stages[:2] == ["running the baselines", "reading a plan off the relaxation"]
    assert "building the model" not in stages and "searching for the least cost" not in stages
    assert result.info["stopped_in"].startswith(
        ("improving the hint", "proving a bound", "building the model"))
    assert result.info["from_hint"]
    if deterministic:  # the fake wall clock passed its end: the plan is not reproducible
        assert result.info["deterministic"].startswith("cut by the wall-clock limit")


def test_the_watchdog_stops_the_search_when_the_deadline_passes():
    """Each improving schedule "takes" 1,000 s: the watchdog stops CP-SAT at the first (its own
    limit is 600 s), the least-peak stage finds no time, and the plan that was found stands."""
    clock = FakeClock()
    seen = []

    def tick(entry):
        seen.append(entry)
        clock.now += 1000.0

    # A search that the first schedule does not end: transformer_ops(500) at half its peak is
    # proven OPTIMAL from the relaxation's plan now that the plan is hinted in full.
    problem = unet()
    budget = int(0.6 * make_schedule(problem, []).peak)
    options = SolverOptions(time_limit=600, relative_gap=0, model="single", clock=clock,
                            deterministic=False, on_solution=tick)
    result = solve(problem, budget, Strategy.OPTIMAL, options)
    assert result.peak <= budget and seen
    assert "searching for the least cost" in _stage_names(result)
    assert result.info["peak_stage"] == "skipped: no time left"
    assert result.info["stopped_in"] == "searching for the least cost (stopped at the deadline)"
    assert result.cost <= seen[-1]["cost"] * (1 + 1e-6) + 1e-12


def test_the_plan_does_not_read_the_clock_in_deterministic_mode():
    """In deterministic mode a frozen clock and one that runs a second per read give the same
    plan: no decision reads the clock (the wall-clock limit, 10**7 s, is never reached)."""
    problem = transformer_ops(500)
    budget = make_schedule(problem, []).peak // 2
    frozen = FakeClock()

    class Running(FakeClock):
        def __call__(self) -> float:
            self.now += 1.0
            return self.now

    plans = []
    for clock in (frozen, Running()):
        options = SolverOptions(time_limit=1e7, deterministic=True, deterministic_time=0.5,
                                relative_gap=0, model="single", clock=clock)
        result = solve(problem, budget, Strategy.OPTIMAL, options)
        assert result.info["deterministic"] is True
        plans.append((result.recomputed, tuple(sorted(result.recompute_at.items()))))
    assert plans[0] == plans[1]


def test_rich_returns_the_single_models_plan_when_no_time_is_left_for_the_rich_model(
        monkeypatch):
    """At the single model's least peak no baseline fits; when the time runs out before the
    rich model can be built, "rich" and "auto" return the single model's plan, never less."""
    problem = transformer(layers=2)
    single_options = SolverOptions(time_limit=20, model="single", relative_gap=0)
    with pytest.raises(BudgetError) as below:
        solve(problem, 0, Strategy.OPTIMAL, single_options)
    budget = below.value.smallest
    single = solve(problem, budget, Strategy.OPTIMAL, single_options)
    clock = FakeClock()
    real = rich_search.recompute_bound

    def spend_it_all(*args, **kwargs):  # the rich bound "takes" the rest of the limit
        found = real(*args, **kwargs)
        clock.now += 1000.0
        return found

    monkeypatch.setattr(rich_search, "recompute_bound", spend_it_all)
    for model in ("rich", "auto"):
        result = solve(problem, budget, Strategy.OPTIMAL,
                       SolverOptions(time_limit=20, model=model, relative_gap=0, clock=clock,
                                     deterministic=False))
        assert result.peak <= budget
        assert result.cost <= single.cost * (1 + 1e-9), model
        assert result.info["model"] == "single"
        if model == "rich" and result.cost < single.cost * (1 - 1e-4):
            pytest.fail("the rich bound proved the single plan optimal: nothing was tested")


_SOLVE_IN_A_PROCESS = textwrap.dedent("""
    import json, sys
    from remat.solvers import SolverOptions, Strategy, make_schedule, solve
    from tests.synthetic.problems import transformer_ops
    problem = transformer_ops(2000)
    budget = make_schedule(problem, []).peak // 2
    result = solve(problem, budget, Strategy.OPTIMAL,
                   SolverOptions(time_limit=600, deterministic=True,
                                 deterministic_time=float(sys.argv[1])))
    print(json.dumps({"recomputed": sorted(result.recomputed),
                      "at": sorted(result.recompute_at.items()), "cost": result.cost,
                      "status": result.status.value,
                      "deterministic": result.info["deterministic"]}))
""")


@pytest.mark.slow
def test_two_processes_plan_the_same_schedule():
    """Deterministic mode: two processes at once (each other's load) solving the same 2,000-op
    problem give the same schedule, with the search stopped by its deterministic time before it
    proves optimality (so the stop itself is reproducible)."""
    root = Path(__file__).resolve().parents[2]
    runs = [subprocess.Popen([sys.executable, "-c", _SOLVE_IN_A_PROCESS, "3"], cwd=root,
                             stdout=subprocess.PIPE, text=True) for _ in range(2)]
    results = [json.loads(run.communicate(timeout=900)[0].splitlines()[-1]) for run in runs]
    assert all(r["deterministic"] is True for r in results), results
    assert results[0] == results[1]


def test_baselines_skipped_for_time_run_in_the_time_the_later_stages_leave(monkeypatch):
    """A loaded machine as the driver sees it: an evaluation measured at 3 s, so the prefix
    searches (greedy, selective) are predicted past the pool's share and skipped; the relaxation
    reads no plan; the model would take too long to build. What the later stages left goes to
    the skipped baselines: the call returns greedy's plan, not the fixed plan the pool had."""
    from remat.solvers.relaxation.bound import Bound
    from remat.solvers.cpsat.hints import Pool

    monkeypatch.setattr(Pool, "evaluation", lambda self, deterministic: 3.0)
    monkeypatch.setattr(driver, "relaxed_schedule",
                        lambda *args, **kwargs: (None, Bound(0.0, (), True)))
    problem = transformer_ops(500)
    budget = int(0.7 * make_schedule(problem, []).peak)
    greedy = solve(problem, budget, Strategy.GREEDY, SolverOptions())
    result = solve(problem, budget, Strategy.OPTIMAL,
                   SolverOptions(time_limit=60, relative_gap=0, model="single"))
    assert result.info["model_build"].startswith("not built")
    assert result.info["hint"] == "greedy" and "greedy" not in result.info.get("skipped", {})
    assert result.peak <= budget and result.cost <= greedy.cost
