"""The least-peak descent: every plan it returns is what the simulator says, never below the
least peak that brute force proves, never above its start; on a stack of blocks it goes below
per-block checkpointing; a target stops it no lower than it would go."""
import math

from hypothesis import HealthCheck, assume, given, settings, strategies as st

from remat.solvers import SolverOptions, make_schedule, simulate
from remat.solvers.baselines.standard import checkpoint_blocks
from remat.solvers.core.deadline import Deadline
from remat.solvers.relaxation.descent import descend
from tests.oracles.brute_least import brute_least_peak
from tests.synthetic.problems import random_problem, transformer


def _steady(seconds: float) -> Deadline:
    """Planned on deterministic time: the same moves and plans however busy the machine (the
    wall clock only bounds it, at ten times as long)."""
    return Deadline(10 * seconds, deterministic=True, planned=seconds)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2 ** 32 - 1))
def test_descent_stays_between_the_brute_force_least_and_its_start(seed):
    problem = random_problem(seed, max_forward=9, max_backward=5)
    floor = brute_least_peak(problem)
    assume(floor is not None)
    start = make_schedule(problem, [])
    found = descend(problem, start, _steady(30))
    assert found.peak == simulate(problem, found).peak
    assert floor <= found.peak <= start.peak


def test_descent_goes_below_per_block_on_a_stack():
    problem = transformer(layers=6, batch=2, seq=256, d_model=256, heads=4)
    blocks = checkpoint_blocks(problem, math.inf, SolverOptions())
    found = descend(problem, blocks, _steady(60))
    assert found.peak == simulate(problem, found).peak
    assert found.peak < 0.97 * blocks.peak, (found.peak, blocks.peak)


def test_descent_stops_at_the_target():
    problem = transformer(layers=6, batch=2, seq=256, d_model=256, heads=4)
    blocks = checkpoint_blocks(problem, math.inf, SolverOptions())
    target = blocks.peak - 1
    found = descend(problem, blocks, _steady(60), target=target)
    deepest = descend(problem, blocks, _steady(60))
    assert found.peak <= target
    assert deepest.peak <= found.peak
