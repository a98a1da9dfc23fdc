"""What `optimal` says about its plans is true: its status and gap against the oracle, its bounds
never above the optimum, its time limit kept, its least peak feasible when fed back, its
messages consistent, and a progress line while it searches."""
import logging
import math
import pathlib
import random
import threading
import time
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, assume, given, settings, strategies as st

from remat.errors import BudgetError
from remat.solvers import Problem, SolverOptions, Status, Strategy, make_schedule, simulate, solve
from remat.solvers.cpsat import search
from remat.solvers.core.schedule import OPTIMAL_TOLERANCE
from remat.solvers.relaxation.bound import peak_bound
from remat.solvers.cpsat.least_peak import too_small
from remat.solvers.core.deadline import Deadline
from remat.solvers.core.problem_file import loads
from tests.oracles.brute_least import brute_least_peak
from tests.synthetic.problems import random_problem, transformer, transformer_ops, with_free_values

# The default cost resolution; the single model, whose space Strategy.BRUTE_FORCE enumerates.
DEFAULT = SolverOptions(workers=2, time_limit=20, model="single")


def uneven_costs(problem: Problem, seed: int) -> Problem:
    """`problem` with costs spread over six orders of magnitude and off any grid, where a cost
    unit tied to the step's total (the old rule) rounded the small ones to nothing."""
    rng = random.Random(seed)
    ops = tuple(replace(op, cost=op.cost * math.pi * 10 ** -rng.uniform(0, 6)) for op in problem.ops)
    return Problem(ops, name=problem.name)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2 ** 32 - 1), where=st.floats(0.0, 1.0))
def test_bound_status_and_gap_are_true_against_brute_force(seed, where):
    problem = uneven_costs(random_problem(seed, max_forward=10, max_backward=6), seed)
    low = brute_least_peak(problem)
    assume(low is not None)  # None: too many schedules to enumerate
    high = simulate(problem, make_schedule(problem, [])).peak
    budget = low + int(where * (high - low))
    oracle = solve(problem, budget, Strategy.BRUTE_FORCE, DEFAULT)
    exact = solve(problem, budget, Strategy.OPTIMAL, DEFAULT)
    assert exact.bound <= oracle.cost * (1 + 1e-12), "a bound above a feasible cost"
    assert exact.cost >= oracle.cost * (1 - 1e-12)
    if exact.cost > 0:
        assert exact.gap == pytest.approx(max(0.0, (exact.cost - exact.bound) / exact.cost))
    if exact.status is Status.OPTIMAL:
        assert exact.cost - exact.bound <= OPTIMAL_TOLERANCE * exact.cost
        assert exact.cost <= oracle.cost * (1 + 2 * OPTIMAL_TOLERANCE)


def test_gap_is_cost_against_bound_for_every_status():
    problem = transformer(layers=2)
    budget = int(0.8 * simulate(problem, make_schedule(problem, [])).peak)
    seen = set()
    for limit in (0.3, 10):
        result = solve(problem, budget, Strategy.OPTIMAL, SolverOptions(workers=2, time_limit=limit))
        seen.add(result.status)
        assert result.bound is not None and result.cost > 0
        assert result.gap == pytest.approx(max(0.0, (result.cost - result.bound) / result.cost))
        assert (result.status is Status.OPTIMAL) == (result.gap <= OPTIMAL_TOLERANCE)
    assert seen  # the statuses met; the assertions above hold for each


class StallingClock:
    """The wall clock, jumped STALL seconds forward at the `reads`-th look at it after
    `arm(reads)` (by any thread): a machine that stalls the call there, as a loaded one does
    between two looks at the clock."""

    STALL = 1000.0

    def __init__(self):
        self.offset, self.countdown = 0.0, None
        self.lock = threading.Lock()

    def arm(self, reads: int) -> None:
        self.countdown = reads
        if reads == 0:
            self.offset = self.STALL

    def __call__(self) -> float:
        with self.lock:  # read by the call, its watchdogs and its progress thread
            if self.countdown:
                self.countdown -= 1
                if self.countdown == 0:
                    self.offset = self.STALL
            return time.perf_counter() + self.offset


@pytest.mark.parametrize("stage,reads", [("running the baselines", 0),
                                         ("running the baselines", 10),
                                         ("reading a plan off the relaxation", 0),
                                         ("reading a plan off the relaxation", 10)])
def test_a_call_of_10k_ops_stops_where_its_clock_runs_out(monkeypatch, caplog, stage, reads):
    """The call's clock stalls as `stage` begins or at its `reads`-th look at the clock after
    that: no stage starts after the stall but the result's, a CP-SAT search that runs is
    stopped, the plan found so far fits (or, stalled before a baseline that fits ran, the first
    fixed plan that fits, run past the deadline as the result, HEURISTIC, `Pool.last_resort`;
    or the error names per-block checkpointing's peak as found), the stage that found no time
    is named, and progress lines with the incumbent and the bound come while it runs. Nothing here reads the wall clock: only the stall passes
    the limit, 600 s, so that every stage before the stall runs whatever the machine's
    load."""
    monkeypatch.setattr(search, "PROGRESS_SECONDS", 0.05)
    clock = StallingClock()
    enter = Deadline.enter

    def entering(deadline, name):
        enter(deadline, name)
        if name == stage:
            clock.arm(reads)

    monkeypatch.setattr(Deadline, "enter", entering)
    problem = transformer_ops(10_000)
    budget = simulate(problem, make_schedule(problem, [])).peak // 2
    caplog.set_level(logging.INFO, logger="remat.solvers.cpsat.search")
    options = SolverOptions(workers=2, time_limit=600, clock=clock, deterministic=False)
    try:
        result = solve(problem, budget, Strategy.OPTIMAL, options)
    except BudgetError as error:  # stalled before a baseline ran; per-block does not fit
        assert stage == "running the baselines", error
        assert error.proven is False and "not proven the least" in str(error)
        assert error.smallest == solve(problem, 10 ** 15, Strategy.CHECKPOINT_BLOCKS).peak
        return
    stages = result.info["stages"]
    assert clock.offset, f"the clock never stalled ({stage!r}, {reads}): {stages}"
    resort = "last_resort" in result.info  # run past the deadline: nothing else fitted
    assert result.peak <= budget and result.status in (
        (Status.HEURISTIC,) if resort else (Status.FEASIBLE, Status.OPTIMAL))
    after = {name for name, at in stages if at >= StallingClock.STALL}
    assert after <= {"finishing", "done"}, stages
    assert "stopped_in" in result.info or result.info.get("skipped"), stages
    if stage == "running the baselines" and reads == 0:  # no baseline ran before the stall
        assert resort and "run past the deadline" in result.info["skipped"][result.info["hint"]]
    lines = [r.getMessage() for r in caplog.records if "best recompute cost" in r.getMessage()]
    assert lines and all("bound" in line for line in lines)


def test_skipped_baselines_are_named():
    problem = transformer_ops(2000)
    budget = simulate(problem, make_schedule(problem, [])).peak // 2
    result = solve(problem, budget, Strategy.OPTIMAL, SolverOptions(workers=2, time_limit=0.5))
    assert result.peak <= budget
    skipped = result.info["skipped"]
    assert skipped and all(s in {x.value for x in Strategy} for s in skipped)
    assert all("s left" in why for why in skipped.values())


REGRESSION = sorted((pathlib.Path(__file__).parents[1] / "regression").glob("*.json"))


@pytest.mark.parametrize("path", REGRESSION, ids=lambda p: p.stem)
def test_the_smallest_budget_named_is_feasible(path):
    problem, extra = loads(path.read_text())
    options = SolverOptions(workers=2, time_limit=20, **extra["options"])
    with pytest.raises(BudgetError) as below:
        solve(problem, 0, Strategy.OPTIMAL, options)
    smallest = below.value.smallest
    assert below.value.schedule.peak == smallest
    at = solve(problem, smallest, Strategy.OPTIMAL, options)
    assert at.peak <= smallest


def test_checkpoint_blocks_budget_gets_a_plan_in_little_time():
    """Where per-block checkpointing fits, a plan comes back, however short the limit."""
    problem = transformer(layers=4, batch=2, seq=64, d_model=64, heads=4)
    blocks = solve(problem, 10 ** 15, Strategy.CHECKPOINT_BLOCKS)
    for limit in (0.2, 2.0):
        result = solve(problem, blocks.peak, Strategy.OPTIMAL,
                       SolverOptions(workers=2, time_limit=limit))
        assert result.peak <= blocks.peak


def test_budget_error_says_which_figure_is_proven():
    """A request between the proven floor and the least peak found: the message names both,
    the floor as proven, and does not claim that recomputation cannot go lower."""
    problem = transformer(layers=2)
    save_all = make_schedule(problem, [])  # "found": far above the floor
    floor = math.floor(peak_bound(problem, workers=2).value)
    assert floor < save_all.peak
    deadline = Deadline(10)
    between = too_small(problem, (floor + save_all.peak) // 2, save_all, False, DEFAULT, deadline)
    text = str(between)
    assert "cannot go lower" not in text
    assert f"{floor:,} bytes (proven)" in text and f"least peak found is {save_all.peak:,}" in text
    assert between.smallest == save_all.peak
    below = too_small(problem, floor - 1, save_all, False, DEFAULT, deadline)
    assert f"no schedule peaks below {floor:,} bytes (proven)" in str(below)
    proven = too_small(problem, floor - 1, save_all, True, DEFAULT, deadline)
    assert "(proven); recomputation cannot go lower" in str(proven)
    assert (between.proven, below.proven, proven.proven) == (False, False, True)
    # No time for the floor's proof (0 bytes proven): no floor is named, and a budget of 0,
    # the least peak asked for, has words of its own.
    expired = Deadline(10, clock=lambda: 0.0).within(0)
    for budget, words in ((0, "every schedule holds some activations"),
                          (floor, "no floor was proven in the time")):
        error = too_small(problem, budget, save_all, False, DEFAULT, expired)
        assert words in str(error) and "(proven)" not in str(error)
        assert "not proven the least" in str(error) and "longer time_limit" in str(error)
        assert error.proven is False and error.smallest == save_all.peak


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2 ** 32 - 1), where=st.floats(0.0, 1.0))
def test_bound_and_status_are_true_where_recomputations_fuse(seed, where):
    """With values a compiled step fuses into their readers, in the just-in-time space that
    compiled plans are solved in: no bound above the oracle's cost, no OPTIMAL above it, and no
    refusal of a budget the oracle meets. (The bounds alone: tests/solvers/test_bound.py.)"""
    rng = random.Random(seed)
    problem = with_free_values(random_problem(seed, max_forward=rng.randint(2, 10),
                                              max_backward=rng.randint(1, 6)), rng)
    assume(problem.fused_recomputations)
    options = replace(DEFAULT, free_positions=False)
    try:
        low = solve(problem, 0, Strategy.BRUTE_FORCE, options).peak
    except ValueError:
        assume(False)  # too many schedules to enumerate
    except BudgetError as error:
        low = error.smallest
    high = simulate(problem, make_schedule(problem, [])).peak
    budget = low + int(where * (high - low))
    oracle = solve(problem, budget, Strategy.BRUTE_FORCE, options)
    exact = solve(problem, budget, Strategy.OPTIMAL, options)
    assert exact.bound <= oracle.cost * (1 + 1e-12) + 1e-15, "a bound above a feasible cost"
    if exact.status is Status.OPTIMAL:
        assert exact.cost <= oracle.cost * (1 + 2 * OPTIMAL_TOLERANCE) + 1e-15
