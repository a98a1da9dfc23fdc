"""The right error first when the time runs out, in both execution modes, on a clock that
leaves the solver no time at all (each read 1,000 s after the last): a budget that per-block
checkpointing meets always gets a plan (HEURISTIC, why in info["last_resort"]), and where
nothing fits, BudgetError names a smallest budget labelled found, not proven, that gets a
plan when fed back. Nothing here reads the wall clock."""
from __future__ import annotations

import pytest

from remat.errors import BudgetError
from remat.solvers import SolverOptions, Status, Strategy, make_schedule, solve
from tests.synthetic.problems import transformer, unet


class NoTime:
    """A clock 1,000 s later at every read: no stage of a call ever finds time left."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1000.0
        return self.now


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
