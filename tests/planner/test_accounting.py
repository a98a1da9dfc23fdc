"""The whole step's peak from its terms: one meaning of "activations" (the step's peak less the
state), gradients counted once, and the BudgetError that names the real largest term
and the remedy that acts on it."""
import pytest

from remat.errors import BudgetError
from remat.planner.job.accounting import (activation_allowance, budget_error, graph_gradients,
                                      smallest_budget, step_memory)
from remat.planner.job.training import Training, state_memory
from remat.solvers import Op, Phase, Problem, make_schedule, simulate
from remat.solvers.core.problem import Kind

F, B = Phase.FORWARD, Phase.BACKWARD


def mlp():
    """x -> h -> y -> loss; gradients of two weights (is_output backward ops, gw1 a view)."""
    return Problem((
        Op("h", F, (), 1000, module="l.0"), Op("a", F, (0,), 1000, module="l.0"),
        Op("y", F, (1,), 500, module="l.1"), Op("loss", F, (2,), 4, is_output=True),
        Op("gy", B, (3,), 500), Op("mm1", B, (4, 1), 300),
        Op("gw1", B, (5,), 0, kind=Kind.VIEW, is_output=True),
        Op("ga", B, (4,), 1000), Op("gh", B, (7, 0), 1000),
        Op("gw0", B, (8,), 200, is_output=True),
    ), source={"param_gradients": ["gw1", "gw0"]})


def test_graph_gradients_are_their_storages_once():
    assert graph_gradients(mlp()) == 300 + 200  # gw1 is a view of mm1's 300 bytes
    assert graph_gradients(Problem(mlp().ops)) == 0  # a problem that names none


def test_activations_are_the_peak_less_the_state_and_the_total_adds_up():
    problem = mlp()
    schedule = make_schedule(problem, (), strategy="save_all")
    training = Training(reserve=777)
    state = state_memory([("w0", (10, 5)), ("w1", (10, 7))], training)
    grads = graph_gradients(problem)
    memory = step_memory(schedule, state, training, graph_gradients=grads,
                         gradients_in_graph=True, budget=10**10)
    assert memory.activation_peak == simulate(problem, schedule).peak - grads
    assert memory.total == (state.total + memory.activation_peak + 777 + memory.margin)
    rows = {name: (size, counted) for name, size, counted, _ in memory.rows()}
    assert rows["gradients"] == (state.gradients, True)
    assert sum(size for size, counted in rows.values() if counted) == memory.total


def test_gradient_buffers_of_their_own_leave_the_graphs_gradients_in_the_activations():
    problem = mlp()
    schedule = make_schedule(problem, (), strategy="save_all")
    training = Training(precision="bf16-mixed")
    state = state_memory([("w0", (10, 5))], training)
    memory = step_memory(schedule, state, training, graph_gradients=0,
                         gradients_in_graph=False, budget=10**10)
    assert memory.activation_peak == schedule.peak
    rows = {name: (size, counted) for name, size, counted, _ in memory.rows()}
    assert rows["gradients"] == (state.gradients, True)
    assert sum(size for size, counted in rows.values() if counted) == memory.total


def test_an_activation_budget_adds_no_reserve_to_the_total():
    problem = mlp()
    schedule = make_schedule(problem, ())
    training = Training()  # 1 GiB of reserve by default
    state = state_memory([("w0", (10, 5))], training)
    memory = step_memory(schedule, state, training, graph_gradients=500,
                         gradients_in_graph=True, budget=None)
    assert memory.total == state.total + memory.activation_peak
    rows = {name: (size, counted) for name, size, counted, _ in memory.rows()}
    assert rows["reserve"] == (2**30, False)
    assert sum(size for size, counted in rows.values() if counted) == memory.total


@pytest.mark.parametrize("fragmentation", [0.0, 0.1, 0.15, 0.333])
def test_smallest_budget_inverts_the_allowance(fragmentation):
    training = Training(fragmentation=fragmentation, reserve=12345)
    state = state_memory([(1000, 999)], training)
    for peak in (0, 1, 10**6, 123_456_789):
        b = smallest_budget(peak, state, training)
        assert activation_allowance(b, state, training) >= peak
        assert activation_allowance(b - 1, state, training) < peak


def seven_b():
    h, layers, vocab = 4096, 32, 32000
    return [(vocab, h), (vocab, h)] + [(h, h)] * 4 * layers + [(4 * h, h), (h, 4 * h)] * layers


def test_state_dominated_error_never_suggests_a_smaller_batch():
    training = Training(precision="bf16-mixed", optimizer="adamw")
    state = state_memory(seven_b(), training)
    error = budget_error(80 * 10**9, smallest_activations=2 * 10**9, state=state,
                         training=training)
    assert isinstance(error, BudgetError)
    assert error.dominant == "optimizer state"
    assert "ZeRO" in error.remedy and "8-bit Adam" in error.remedy
    assert "micro-batch" not in str(error) and "micro-batch" not in error.remedy
    assert error.smallest == smallest_budget(2 * 10**9, state, training)
    assert error.smallest > 121 * 10**9
    assert "more than the budget, whatever the plan and the batch" in str(error)
    assert f"{error.smallest:,}" in str(error)


def test_parameters_alone_exceeding_the_device_say_split_the_model():
    training = Training(precision="fp32", optimizer="sgd")
    state = state_memory([(20 * 10**9,)], training)  # 80 GB of weights
    error = budget_error(60 * 10**9, smallest_activations=10**9, state=state,
                         training=training)
    assert error.dominant == "parameters"
    assert "split the model" in error.remedy and "micro-batch" not in str(error)


def test_activation_dominated_error_suggests_micro_batch():
    training = Training(optimizer="adamw", reserve=0)
    state = state_memory([(1000, 1000)], training)  # 16 MB of state
    error = budget_error(10**9, smallest_activations=5 * 10**9, state=state, training=training)
    assert error.dominant == "activations"
    assert "micro-batch" in error.remedy and "gradient accumulation" in error.remedy
    assert error.smallest == smallest_budget(5 * 10**9, state, training)
    assert error.budget == 10**9
    assert "the smallest activation peak: 5.00 GB" in str(error)


@pytest.mark.parametrize("optimizer, budget", [("sgd", 10**9), ("adamw", 2**30 + 10**6)])
def test_a_small_model_under_the_default_reserve_blames_the_reserve(optimizer, budget):
    """Under the default 1 GiB reserve a small model's largest term is the reserve: the message
    names it, not the parameters (1 KB) or the optimizer state."""
    training = Training(optimizer=optimizer)
    state = state_memory([(16, 16)], training)  # 1 KB of weights
    error = budget_error(budget, smallest_activations=10**4, state=state, training=training)
    assert error.dominant == "reserve"
    assert "Training(reserve=...)" in error.remedy
    assert "the largest term is reserve (1.07 GB)" in str(error)
    assert error.smallest == smallest_budget(10**4, state, training)
    assert error.smallest > 2**30


def test_the_margin_is_a_term_of_its_own():
    training = Training(optimizer="sgd", reserve=0, fragmentation=0.5)
    state = state_memory([(16, 16)], training)
    error = budget_error(10**6, smallest_activations=10**5, state=state, training=training)
    assert error.dominant == "fragmentation margin"
    assert "Training(fragmentation=...)" in error.remedy
