"""The rich space's repair: second backward runs where a plan peaks (`repair_again.settle`) and
the plan read off the relaxation with them (`rich_relaxed.rich_relaxed_plan`), against the
exhaustive search over the rich space (`rich_brute_force`) and the simulator."""
import random

from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from remat.solvers.core.deadline import Deadline
from remat.solvers.core.problem import Problem
from remat.solvers.relaxation.repair import repair
from remat.solvers.relaxation.second_runs import settle
from tests.oracles.rich_brute import rich_brute_force, rich_smallest_peak
from remat.solvers.relaxation.rich_relaxed import rich_relaxed_plan
from remat.solvers.core.schedule import drop_unneeded, recomputable
from remat.solvers.timeline.evaluate import make_schedule
from remat.solvers.timeline.simulate import simulate
from tests.synthetic.problems import random_problem
from tests.solvers.test_rich_solver import long_skip


def far_reader() -> Problem:
    """x (cheap, 10 bytes) is read by the forward's first and last ops and by the backward's
    first and last: recomputed for g3, it is held to g0 (tests/solvers/test_rich_solver.py's long
    skip, layers of 2 bytes, gradients of 5)."""
    return long_skip(skip=10, layer=2, grad=5)


def test_a_value_held_to_a_far_reader_is_run_again_before_it():
    """Budget 23: x recomputed before g3 and held to g0 peaks above it; run again before g0
    it fits at cost 2, the rich space's optimum (the single space's is 10)."""
    problem, budget = far_reader(), 23
    x, g0 = problem.index("x"), problem.index("g0")
    plan = make_schedule(problem, {x})
    assert plan.peak > budget
    fitted = settle(problem, plan, budget, Deadline(10.0))
    assert fitted.again == {x: (g0,)}
    assert fitted.peak == simulate(problem, fitted).peak <= budget
    assert fitted.cost == 2.0 == rich_brute_force(problem, budget, max_copies=1).cost


def test_settle_leaves_a_plan_alone_where_no_run_helps():
    problem = far_reader()
    x = problem.index("x")
    plan = make_schedule(problem, {x})
    assert settle(problem, plan, plan.peak, Deadline(10.0)) is plan  # it fits already
    save_all = make_schedule(problem, ())  # nothing recomputed: nothing to run again
    assert settle(problem, save_all, 0, Deadline(10.0)) is save_all


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2 ** 32 - 1), where=st.floats(0.0, 0.7),
       picks=st.integers(0, 2 ** 16))
def test_rich_repairs_fit_and_never_beat_the_exhaustive_optimum(seed, where, picks):
    """On random small steps: what settle, the repair with it and the rich plan return runs
    (make_schedule's checks), simulates to the peak it claims, never peaks above the plan it
    started from (settle), fits where it says so, and never costs less than the exhaustive
    search's optimum over the rich space (up to two further runs a value)."""
    problem = random_problem(seed, max_forward=6, max_backward=5)
    try:
        low = rich_smallest_peak(problem, max_copies=2)
    except ValueError:  # too many schedules to enumerate
        assume(False)
    high = simulate(problem, make_schedule(problem, ())).peak
    budget = low + int(where * max(0, high - low))
    try:
        oracle = rich_brute_force(problem, budget, max_copies=2)
    except ValueError:
        assume(False)
    candidates = recomputable(problem)
    chosen = {v for k, v in enumerate(candidates) if picks >> k & 1}
    try:
        start = make_schedule(problem, drop_unneeded(problem, chosen))
    except ValueError:
        start = make_schedule(problem, ())
    settled = settle(problem, start, budget, Deadline(10.0))
    repaired = repair(problem, start, budget, Deadline(10.0),
                      lambda s: settle(problem, s, budget, Deadline(10.0)))
    found = rich_relaxed_plan(problem, budget, [], Deadline(10.0))
    assert settled.peak <= start.peak
    for plan in (settled, repaired, found):
        if plan is None:
            continue
        again = make_schedule(problem, plan.recomputed, recompute_at=plan.recompute_at,
                              again=plan.again)  # runs: every further copy is read
        assert plan.peak == again.peak == simulate(problem, plan).peak
        assert plan.cost == again.cost
        if plan.peak <= budget:
            assert plan.cost >= oracle.cost * (1 - 1e-9) - 1e-12
    assert repaired is None or repaired.peak <= budget
    assert found is None or found.peak <= budget


def test_second_runs_on_seeded_random_steps():
    """Seeded random steps and plans (recomputing a random half of what may be): where settle
    adds second runs, the plan runs, simulates to its peak, peaks lower than it started, and
    where it fits costs no less than the exhaustive optimum over the rich space. Some do add
    them (else this tests nothing)."""
    added = 0
    for seed in range(120):
        problem = random_problem(seed, max_forward=6, max_backward=5)
        try:
            low = rich_smallest_peak(problem, max_copies=2)
        except ValueError:
            continue
        high = simulate(problem, make_schedule(problem, ())).peak
        rng = random.Random(seed)
        budget = low + int(rng.random() * 0.7 * max(0, high - low))
        chosen = {v for v in recomputable(problem) if rng.random() < 0.5}
        try:
            start = make_schedule(problem, drop_unneeded(problem, chosen))
        except ValueError:
            continue
        settled = settle(problem, start, budget, Deadline(10.0))
        if not settled.again:
            continue
        added += 1
        assert settled.peak == simulate(problem, settled).peak < start.peak
        assert settled.cost > start.cost
        if settled.peak <= budget:
            assert settled.cost >= rich_brute_force(problem, budget, max_copies=2).cost - 1e-9
    assert added >= 3
