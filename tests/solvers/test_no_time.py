"""The right error first when the time runs out, in both execution modes, on a clock that
leaves the solver no time at all (each read 1,000 s after the last): a budget that per-block
checkpointing meets always gets a plan (HEURISTIC, why in info["last_resort"]), and where
nothing fits, BudgetError names a smallest budget labelled found, not proven, that gets a
plan when fed back. Nothing here reads the wall clock."""
from __future__ import annotations

import pytest

from remat.errors import BudgetError
from remat.solvers import SolverOptions, Status, Strategy, make_schedule, solve, solve_eager
from remat.solvers.core.deadline import Deadline
from remat.solvers.eager.heuristic import cheapest_prefix, plan_eager
from remat.solvers.eager.search import optimal_eager
from remat.solvers.timeline.eager import eager_schedule
from tests.synthetic.eager import random_eager
from tests.synthetic.problems import transformer, unet
from tests.clocks import NoTime


def no_time(**kwargs) -> SolverOptions:
    return SolverOptions(time_limit=10, workers=2, clock=NoTime(), deterministic=False,
                         **kwargs)


PROBLEMS = {"transformer": lambda: transformer(layers=4, batch=2, seq=64, d_model=64, heads=4),
            "unet": unet}


def per_block(problem):
    return solve(problem, 10 ** 15, Strategy.CHECKPOINT_BLOCKS)


# --- The compiled mode.

@pytest.mark.parametrize("name", sorted(PROBLEMS))
@pytest.mark.parametrize("model", ["single", "auto"])
def test_a_budget_per_block_checkpointing_meets_gets_a_plan_with_no_time(name, model):
    """At per-block checkpointing's peak and halfway to saving all: its plan, run past the
    deadline, HEURISTIC, the reason given; never SolverError."""
    problem = PROBLEMS[name]()
    blocks, save_all = per_block(problem), make_schedule(problem, [])
    assert blocks.peak < save_all.peak
    for budget in (blocks.peak, (blocks.peak + save_all.peak) // 2):
        result = solve(problem, budget, Strategy.OPTIMAL, no_time(model=model))
        assert result.peak <= budget
        assert result.recomputed == blocks.recomputed
        assert result.status is Status.HEURISTIC
        assert "run past the deadline" in result.info["last_resort"]


@pytest.mark.parametrize("model", ["single", "auto"])
def test_nothing_fits_and_no_time_names_a_found_smallest_that_fits(model):
    """Below per-block checkpointing's peak with no time for a proof: BudgetError, its
    smallest per-block checkpointing's, labelled found and not proven; fed back, a plan.
    At budget 0 its own words: never a floor of 0 bytes "proven"."""
    problem = PROBLEMS["transformer"]()
    blocks = per_block(problem)
    for budget in (0, blocks.peak - 1):
        with pytest.raises(BudgetError) as info:
            solve(problem, budget, Strategy.OPTIMAL, no_time(model=model))
        error, text = info.value, str(info.value)
        assert error.proven is False and error.smallest == blocks.peak
        assert "not proven the least" in text and "longer time_limit" in text
        assert "below 0 bytes" not in text
        assert ("every schedule holds some activations" in text) == (budget == 0)
    fed_back = solve(problem, error.smallest, Strategy.OPTIMAL, no_time(model=model))
    assert fed_back.peak <= error.smallest


# --- The eager mode.

def eager_problems():
    return [random_eager(seed, max_forward=11, max_backward=8, max_cacheable=11)
            for seed in range(4)]


@pytest.mark.parametrize("strategy", ["optimal", "greedy"])
def test_eager_a_budget_per_block_checkpointing_meets_gets_a_plan_with_no_time(strategy):
    for problem, blocks in eager_problems():
        budget = eager_schedule(problem, blocks, ()).peak
        result = solve_eager(problem, blocks, budget, strategy, no_time())
        assert result.peak <= budget
        if "last_resort" in result.info:
            assert result.status is Status.HEURISTIC


def test_eager_per_block_checkpointing_is_the_last_resort_of_both_planners():
    """No policy given fits and there is no time: the exact search returns per-block
    checkpointing, HEURISTIC; the heuristic, its seeds unrepaired, likewise."""
    for problem, blocks in eager_problems():
        blocks_plan = eager_schedule(problem, blocks, ())
        budget = blocks_plan.peak
        expired = Deadline(10.0, clock=NoTime())
        found = optimal_eager(problem, blocks, budget, no_time(), deadline=expired)
        assert found.info["cached"] == blocks_plan.info["cached"] and found.peak <= budget
        if found.status is not Status.OPTIMAL:  # OPTIMAL: it recomputes nothing
            assert found.status is Status.HEURISTIC
            assert "every block checkpointed" in found.info["last_resort"]
        if eager_schedule(problem, blocks, blocks.cacheable).peak <= budget:
            continue  # the seed fits unrepaired: no last resort needed
        heuristic = plan_eager(problem, blocks, budget, [blocks.cacheable], expired)
        assert heuristic.info["cached"] == blocks_plan.info["cached"]
        assert heuristic.status is Status.HEURISTIC and "last_resort" in heuristic.info


@pytest.mark.parametrize("strategy", ["optimal", "greedy"])
def test_eager_nothing_fits_and_no_time_is_a_budget_error_labelled_found(strategy):
    """Budget 0 with no time (mT5's case): BudgetError, not SolverError, its smallest
    labelled found; fed back, a plan."""
    for problem, blocks in eager_problems():
        with pytest.raises(BudgetError) as info:
            solve_eager(problem, blocks, 0, strategy, no_time())
        error, text = info.value, str(info.value)
        assert error.proven is False and "not proven the least" in text
        assert "below 0 bytes" not in text
        assert solve_eager(problem, blocks, error.smallest, strategy, no_time()).peak \
            <= error.smallest


def test_eager_first_seed_stops_at_the_deadline():
    """The bisection for the first seed runs under the heuristic's deadline: with no time it
    evaluates no prefix, returns the empty one and says where it stopped; with time, it
    finds a prefix whose caching fits."""
    stopped = 0
    for problem, blocks in eager_problems():
        budget = eager_schedule(problem, blocks, blocks.cacheable).peak
        found = cheapest_prefix(problem, blocks, budget)
        assert eager_schedule(problem, blocks, found).peak <= budget
        expired = Deadline(10.0, clock=NoTime())
        assert cheapest_prefix(problem, blocks, budget, expired) == frozenset()
        if found:  # there was a bisection to stop
            assert expired.stopped == ("eager: first seed", "no time left")
            stopped += 1
    assert stopped


def test_eager_large_problems_get_no_compiled_seed(monkeypatch):
    """Above COMPILED_SEED_MAX_OPS the eager solve does not run the compiled solver for a
    seed (its model would not be built within its share); below it, it does."""
    import remat.solvers.entry as entry

    problem, blocks = eager_problems()[0]
    budget = eager_schedule(problem, blocks, ()).peak
    calls = []
    compiled = entry.solve

    def counting(*args, **kwargs):
        calls.append(args[0])
        return compiled(*args, **kwargs)

    monkeypatch.setattr(entry, "solve", counting)
    options = SolverOptions(time_limit=10, workers=2, deterministic=False)
    assert solve_eager(problem, blocks, budget, "greedy", options).peak <= budget
    assert calls == [problem]
    monkeypatch.setattr(entry, "COMPILED_SEED_MAX_OPS", len(problem) - 1)
    calls.clear()
    assert solve_eager(problem, blocks, budget, "greedy", options).peak <= budget
    assert calls == []
