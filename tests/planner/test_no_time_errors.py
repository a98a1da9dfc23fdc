"""The right error first, in the user's terms, on a clock that leaves the solver no time (each
read 1,000 s after the last): a state that overflows the budget is a BudgetError before any
solve, in both execution modes, whatever the time limit; a budget that nothing fits in the time
names a smallest labelled found, not proven; and either smallest, fed back, gets a plan on the
same clock (per-block checkpointing, the last resort). Nothing here reads the wall clock."""
import pytest

import remat.planner.plans.eager_plan as eager_plan_module
import remat.planner.plans.plan as plan_module
from remat.errors import BudgetError
from remat.planner.plans.eager_plan import plan_eager_mode
from remat.planner.plans.plan import plan_prepared
from remat.solvers import SolverOptions, Status
from tests.planner.small_gpt import model_inputs, prepared  # noqa: F401 (fixtures)
from tests.clocks import NoTime


def no_time() -> SolverOptions:
    return SolverOptions(time_limit=60, workers=2, clock=NoTime(), deterministic=False)


def plan(execution, model_inputs, prepared, **budgets):
    model, inputs = model_inputs
    if execution == "compiled":
        return plan_prepared(model, prepared, target="h100", solver="optimal",
                             solver_options=no_time(), **budgets)
    return plan_eager_mode(model, prepared, target="h100", solver="optimal",
                           solver_options=no_time(), blocks=None, example_inputs=inputs,
                           **budgets)


@pytest.mark.parametrize("execution", ["compiled", "eager"])
def test_a_state_that_overflows_is_a_budget_error_before_any_solve(monkeypatch, model_inputs,
                                                                   prepared, execution):
    """Llama-1B at 24 GB, whose state alone needs 25.72 GB, in small: the state's terms, the
    remedy of the largest, and per-block checkpointing's budget, labelled found; no solve
    runs. Fed back, that budget gets a plan with no time to solve."""
    def no_solve(*args, **kwargs):
        raise AssertionError("a solve ran where the state alone overflows")

    monkeypatch.setattr(plan_module, "solve", no_solve)
    monkeypatch.setattr(eager_plan_module, "solve_eager", no_solve)
    budget = prepared.state.total // 2
    with pytest.raises(BudgetError) as info:
        plan(execution, model_inputs, prepared, budget=budget, activation_budget=None)
    error, text = info.value, str(info.value)
    assert error.budget == budget and error.dominant == "optimizer state"
    assert "the state: parameters" in text and error.remedy in text
    assert "more than the budget, whatever the plan and the batch" in text
    assert error.proven is False
    assert "found by checkpointing every block, not proven the least" in text
    assert error.smallest > prepared.state.total and f"{error.smallest:,}" in text
    monkeypatch.undo()
    fed_back = plan(execution, model_inputs, prepared, budget=error.smallest,
                    activation_budget=None)
    assert fed_back.peak <= error.smallest


@pytest.mark.parametrize("execution", ["compiled", "eager"])
def test_nothing_fits_in_no_time_names_a_found_smallest(model_inputs, prepared, execution):
    """An activation budget of 0 (mT5's eager case) with no time for a proof: BudgetError, not
    SolverError, its smallest activation peak labelled found; fed back, a plan (compiled:
    per-block checkpointing run past the deadline, HEURISTIC; eager: the heuristic's policy,
    which its few evaluations find, where not that)."""
    with pytest.raises(BudgetError) as info:
        plan(execution, model_inputs, prepared, budget=None, activation_budget=0)
    error, text = info.value, str(info.value)
    assert error.proven is False and error.smallest is not None
    assert "found within the time limit, not proven the least" in text
    assert "below 0 bytes" not in text
    fed_back = plan(execution, model_inputs, prepared, budget=None,
                    activation_budget=error.smallest)
    assert fed_back.activation_peak <= error.smallest
    if execution == "compiled":
        assert fed_back.status is Status.HEURISTIC and "last_resort" in fed_back.schedule.info
