"""The whole step's peak from its terms, with the gradients counted exactly once, and the
BudgetError that says what to do (MEMORY.md, "When the budget is not met")."""
import pytest

from remat.errors import BudgetError
from remat.planner.accounting import (activation_allowance, budget_error, gradients_at_peak,
                                      smallest_budget, step_memory)
from remat.planner.training import Training, state_memory
from remat.solvers import Op, Phase, Problem, make_schedule

F, B = Phase.FORWARD, Phase.BACKWARD


def mlp():
    """x -> h -> y -> loss; gradients of two weights (is_output backward ops)."""
    return Problem((
        Op("h", F, (), 1000, module="l.0"), Op("a", F, (0,), 1000, module="l.0"),
        Op("y", F, (1,), 500, module="l.1"), Op("loss", F, (2,), 4, is_output=True),
        Op("gy", B, (3,), 500), Op("gw1", B, (4, 1), 300, is_output=True),
        Op("ga", B, (4,), 1000), Op("gh", B, (6, 0), 1000),
        Op("gw0", B, (7,), 200, is_output=True),
    ))


def test_gradients_counted_once_when_they_are_the_graphs():
    problem = mlp()
    schedule = make_schedule(problem, (), strategy="save_all")
    state = state_memory([("w0", (10, 5)), ("w1", (10, 7))], Training())
    memory = step_memory(problem, schedule, state, Training(), gradients_in_graph=True,
                         budget=10**10)
    assert memory.gradient_buffers == 0
    assert memory.total == (state.weights + state.optimizer + memory.activation_peak
                            + memory.reserve + memory.margin)
    rows = {name: (size, counted) for name, size, counted, _ in memory.rows()}
    assert rows["gradients"] == (state.gradients, False)  # shown, not added
    assert sum(size for size, counted in rows.values() if counted) == memory.total


def test_gradient_buffers_of_their_own_are_static():
    problem = mlp()
    schedule = make_schedule(problem, (), strategy="save_all")
    training = Training(precision="bf16-mixed")
    state = state_memory([("w0", (10, 5))], training)
    memory = step_memory(problem, schedule, state, training, gradients_in_graph=False,
                         budget=10**10)
    assert memory.gradient_buffers == state.gradients > 0
    rows = {name: (size, counted) for name, size, counted, _ in memory.rows()}
    assert rows["gradients"] == (state.gradients, True)
    assert sum(size for size, counted in rows.values() if counted) == memory.total


def test_gradients_live_at_the_peak():
    problem = mlp()
    peak, grads = gradients_at_peak(problem, make_schedule(problem, ()))
    # The gradient bytes at the peak are those of the output gradients made by then.
    from remat.solvers import simulate
    timeline = simulate(problem, make_schedule(problem, ()))
    at = [s.live for s in timeline.steps].index(peak)
    made = {s.op for s in timeline.steps[:at + 1]}
    assert grads == sum(problem.ops[i].size for i in (5, 8) if i in made)
    assert peak == timeline.peak


@pytest.mark.parametrize("fragmentation", [0.0, 0.1, 0.15, 0.333])
def test_smallest_budget_inverts_the_allowance(fragmentation):
    training = Training(fragmentation=fragmentation, reserve=12345)
    state = state_memory([(1000, 999)], training)
    for peak in (0, 1, 10**6, 123_456_789):
        b = smallest_budget(peak, state, training, gradients_in_graph=True)
        assert activation_allowance(b, state, training, gradients_in_graph=True) >= peak
        assert activation_allowance(b - 1, state, training, gradients_in_graph=True) < peak


def seven_b():
    h, layers, vocab = 4096, 32, 32000
    return [(vocab, h), (vocab, h)] + [(h, h)] * 4 * layers + [(4 * h, h), (h, 4 * h)] * layers


def test_state_dominated_error_never_suggests_a_smaller_batch():
    training = Training(precision="bf16-mixed", optimizer="adamw")
    state = state_memory(seven_b(), training)
    error = budget_error(80 * 10**9, smallest_activations=2 * 10**9, state=state,
                         training=training, gradients_in_graph=False)
    assert isinstance(error, BudgetError)
    assert error.dominant == "optimizer state"
    assert "ZeRO" in error.remedy and "8-bit Adam" in error.remedy
    assert "micro-batch" not in str(error) and "micro-batch" not in error.remedy
    assert error.smallest == smallest_budget(2 * 10**9, state, training,
                                             gradients_in_graph=False)
    assert error.smallest > 121 * 10**9
    assert "the state alone" in str(error)
    assert f"{error.smallest:,}" in str(error)


def test_parameters_alone_exceeding_the_device_say_split_the_model():
    training = Training(precision="fp32", optimizer="sgd")
    state = state_memory([(20 * 10**9,)], training)  # 80 GB of weights
    error = budget_error(60 * 10**9, smallest_activations=10**9, state=state,
                         training=training, gradients_in_graph=True)
    assert error.dominant == "parameters"
    assert "split the model" in error.remedy and "micro-batch" not in str(error)


def test_activation_dominated_error_suggests_micro_batch():
    training = Training(optimizer="adamw", reserve=0)
    state = state_memory([(1000, 1000)], training)  # 16 MB of state
    error = budget_error(10**9, smallest_activations=5 * 10**9, state=state, training=training,
                         gradients_in_graph=True, gradients_in_peak=4 * 10**6)
    assert error.dominant == "activations"
    assert "micro-batch" in error.remedy and "gradient accumulation" in error.remedy
    assert error.smallest == smallest_budget(5 * 10**9, state, training, gradients_in_graph=True)
    assert error.budget == 10**9
