"""A plan far from its bound, or per-block checkpointing returned as a last resort: the report
says so and suggests a `time_limit=` (`remat.planner.plans.gap_advice`), and planning warns.
Schedules are built by hand for the estimate; the plans run on a clock that leaves no time
(`tests.clocks.NoTime`). Nothing here reads the wall clock."""
from __future__ import annotations

import logging
from types import MappingProxyType

import pytest

from remat.planner.plans.eager_plan import plan_eager_mode
from remat.planner.plans.gap_advice import (FALLBACK_FACTOR, GAP_WARN, MOST_FACTOR, gap_advice,
                                            warn_on_gap)
from remat.planner.plans.plan import plan_prepared
from remat.planner.plans.solver_report import SolverSummary, solver_table
from remat.solvers import Schedule, SolverOptions, Status, Strategy
from tests.clocks import NoTime
from tests.planner.small_gpt import model_inputs, prepared  # noqa: F401 (fixtures)


def schedule(cost: float, bound: float | None, solve_time: float, **info) -> Schedule:
    return Schedule(saved=frozenset(), recomputed=frozenset(), recompute_at={},
                    strategy="optimal", status=Status.FEASIBLE, cost=cost, bound=bound,
                    solve_time=solve_time, info=MappingProxyType(info))


def trace(*points: tuple[float, float]) -> list[dict]:
    """An anytime trace of improving plans of cost 1 with gap g at time t."""
    return [{"time": t, "cost": 1.0, "bound": 1.0 - g} for t, g in points]


def test_the_limit_is_extrapolated_from_the_gaps_decay():
    """The gap fell five-fold from 1 s to 3 s (0.5 to 0.1); at the same power of the time it
    falls five-fold again (0.1 to GAP_WARN) from 3 s to 9 s: 3 s * 3."""
    assert GAP_WARN == 0.02
    late = schedule(1.0, 0.9, 3.0, time_limit=3.0, trace=trace((1.0, 0.5)))
    advice = gap_advice(late)
    assert advice.suggested == pytest.approx(9.0)
    assert advice.gap == pytest.approx(0.1) and advice.time_limit == 3.0
    assert "from 50.0 % at 1 s to 10.0 % at 3 s" in advice.how
    assert "time_limit=9" in advice.sentence() and "10.0 % above its bound" in advice.sentence()


def test_a_slow_decay_is_capped_and_a_missing_one_is_a_stated_guess():
    slow = schedule(1.0, 0.6, 3.0, time_limit=3.0, trace=trace((1.0, 0.5)))
    advice = gap_advice(slow)
    assert advice.suggested == MOST_FACTOR * 3.0 and "capped" in advice.how
    # Near flat: the fit's time is past any float; still the cap.
    flat = gap_advice(schedule(1.0, 0.5 + 1e-12, 3.0, time_limit=3.0, trace=trace((1.0, 0.5))))
    assert flat.suggested == MOST_FACTOR * 3.0
    # No trace (the eager search keeps none): a guess, said to be one.
    eager = gap_advice(schedule(1.0, 0.5, 3.0, time_limit=3.0))
    assert eager.suggested == FALLBACK_FACTOR * 3.0 and eager.how.startswith("a guess")
    # A gap that grew (a later trace entry's bound is stronger than the last, impossible in
    # one search but possible across stages) has no decay either.
    grew = gap_advice(schedule(1.0, 0.5, 3.0, time_limit=3.0, trace=trace((1.0, 0.3))))
    assert grew.suggested == FALLBACK_FACTOR * 3.0


def test_no_advice_within_the_threshold_or_without_a_limit():
    assert gap_advice(schedule(1.0, 0.985, 3.0, time_limit=3.0)) is None  # 1.5 %
    assert gap_advice(schedule(1.0, None, 3.0, time_limit=3.0)) is None  # nothing to close
    assert gap_advice(schedule(1.0, 0.1, 3.0)) is None  # a baseline: no limit to raise


def test_a_last_resort_gets_advice_even_without_a_bound(caplog):
    resort = schedule(1.0, None, 3.0, time_limit=3.0, last_resort="no time to search")
    advice = gap_advice(resort)
    assert advice.suggested == FALLBACK_FACTOR * 3.0 and "last resort" in advice.how
    assert "no bound was proven" in advice.sentence()
    with caplog.at_level(logging.WARNING):
        assert warn_on_gap(resort, logging.getLogger("remat.test")) == advice
    assert "time_limit=12" in caplog.text and "no time to search" in caplog.text
    text = solver_table(SolverSummary.of(resort))
    assert "per-block checkpointing: no time to search" in text and "time_limit=12" in text
    # Within the threshold: no warning.
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert warn_on_gap(schedule(1.0, 0.99, 3.0, time_limit=3.0),
                           logging.getLogger("remat.test")) is None
    assert caplog.text == ""


def no_time() -> SolverOptions:
    return SolverOptions(time_limit=60, workers=2, clock=NoTime(), deterministic=False)


@pytest.mark.parametrize("execution", ["compiled", "eager"])
def test_a_plan_made_in_no_time_says_so_in_its_report(model_inputs, prepared, execution,
                                                      caplog):
    """At per-block checkpointing's peak with no time to solve, a plan comes back; where it is
    the last resort (always in the compiled mode) or ends far from its bound, its report and a
    warning say so and suggest a limit."""
    model, inputs = model_inputs
    per_block = prepared.baselines[Strategy.CHECKPOINT_BLOCKS].peak - prepared.graph_gradients
    with caplog.at_level(logging.WARNING):
        if execution == "compiled":
            plan = plan_prepared(model, prepared, budget=None, activation_budget=per_block,
                                 target="h100", solver="optimal", solver_options=no_time())
        else:
            plan = plan_eager_mode(model, prepared, budget=None,
                                   activation_budget=10 * per_block, target="h100",
                                   solver="optimal", solver_options=no_time(), blocks=None,
                                   example_inputs=inputs)
    info, summary = plan.schedule.info, plan.report().solver
    if execution == "compiled":
        assert plan.status is Status.HEURISTIC and info.get("last_resort")
    assert summary.last_resort == info.get("last_resort", "")
    assert summary.advice == gap_advice(plan.schedule)
    text = plan.report().render()
    if summary.last_resort:
        assert f"per-block checkpointing: {summary.last_resort}" in text
    if summary.advice is not None:
        assert summary.advice.sentence() in text and "would likely bring it" in caplog.text
    assert (summary.advice is not None) == bool(
        summary.last_resort or (plan.gap is not None and plan.gap > GAP_WARN))
