"""A module run several times in one step (ALBERT's shared layer) is a block per run: its
calls take the runs' policies in turn, from the first at every call of the model, and only
the calls that run the plan (a ``no_grad`` or ``eval()`` call runs plainly and takes no turn);
the planned call's checks apply to each run, and a saved plan loads with the same runs. Judged
by eager PyTorch's gradients and the allocator's peak."""
from __future__ import annotations

import copy

import pytest
import torch

import remat
from examples.hf_zoo import activation_peak
from remat.errors import RematError
from remat.fx_passes.eager import apply as eager_apply
from remat.planner.plans.prepare import prepare
from remat.solvers import SolverOptions, Strategy
from tests.models import Shared

RUNS = ["layer#0", "layer#1", "layer#2"]


@pytest.fixture(scope="module")
def planned():
    torch.manual_seed(0)
    model = Shared()
    x, y = torch.randn(4, 48, 16), torch.randn(4, 48, 16)
    prepared = prepare(copy.deepcopy(model), (x, y))
    grads = prepared.graph_gradients
    save_all = prepared.baselines[Strategy.SAVE_ALL].peak - grads
    blocks = prepared.baselines[Strategy.CHECKPOINT_BLOCKS].peak - grads
    plan = remat.optimize(copy.deepcopy(model), activation_budget=(save_all + blocks) // 2,
                          example_inputs=(x, y), execution="eager", blocks=["layer"],
                          solver_options=SolverOptions(time_limit=5))
    assert sorted(plan.structure.ops) == RUNS and plan.schedule.recomputed
    # The runs differ (the plan caches in some and not others): a wrong turn shows.
    assert len({p.cache for p in plan.block_policies.values()}) > 1
    reference = copy.deepcopy(model)
    torch.manual_seed(7)
    reference(x, y).backward()
    return model, (x, y), plan, [p.grad for p in reference.parameters()]


def test_each_planned_call_takes_the_next_run_and_each_step_starts_at_the_first(
        planned, monkeypatch):
    base, (x, y), plan, expected = planned
    model = plan.apply(copy.deepcopy(base))
    runs = model.layer._remat_policy
    assert len(runs) == 3
    taken: list[int | str] = []
    checkpointed = eager_apply._checkpointed

    def spy(module, forward, policy, *args, **kwargs):
        plain = not torch.is_grad_enabled() or not module.training
        taken.append("plain" if plain else [r is policy for r in runs].index(True))
        return checkpointed(module, forward, policy, *args, **kwargs)

    monkeypatch.setattr(eager_apply, "_checkpointed", spy)

    def step():
        torch.manual_seed(7)
        model(x, y).backward()

    step()
    assert taken == [0, 1, 2]
    with torch.no_grad():  # evaluation between steps: plain, no turn taken
        model(x, y)
    model.eval()
    model(x, y)  # grad enabled, other mode: plain too (a backward would be refused)
    model.train()
    assert taken[3:] == ["plain"] * 6
    del taken[:]
    model.layer(x)  # a step cut short after its first call: the next step starts over
    step()
    assert taken == [0, 0, 1, 2]
    del taken[:]
    with torch.no_grad():
        model.layer(x)  # takes no turn
    for _ in range(3):  # the block called alone, as the model would: runs in turn all the same
        model.layer(x)
    assert taken == ["plain", 0, 1, 2]
    model.zero_grad(set_to_none=True)
    step()
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), expected))
    measured = activation_peak(step, model)
    assert 0.98 * plan.activation_peak <= measured <= plan.activation_peak, \
        (measured, plan.activation_peak)


def test_a_call_running_the_shared_module_more_often_than_planned_is_refused(planned):
    base, (x, y), plan, expected = planned
    model = plan.apply(copy.deepcopy(base))

    def four_runs(x, y):  # as if the config had grown a layer since planning
        for _ in range(4):
            x = model.layer(x)
        return ((x - y) ** 2).mean()

    model.forward = four_runs
    with pytest.raises(RematError, match="'layer' runs a 4th time .* 3 runs of it"):
        model(x, y)
    del model.forward  # the planned step again: the refused call left no turn behind
    for _ in range(4):  # the block on its own, outside the model: in turn, starting over
        model.layer(x)
    torch.manual_seed(7)
    model(x, y).backward()
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), expected))


def test_the_planned_call_is_checked_for_every_run(planned):
    base, (x, y), plan, _ = planned
    model = plan.apply(copy.deepcopy(base))
    assert {p.path for p in plan.block_policies.values()} == {"layer"}
    with pytest.raises(RematError, match="dtype|float64"):
        model.double()(x.double(), y.double())


def test_a_saved_plan_of_a_shared_module_loads_with_its_runs(planned, tmp_path):
    base, (x, y), plan, expected = planned
    path = tmp_path / "shared.json"
    plan.save(path)
    loaded = remat.load_plan(path, copy.deepcopy(base))
    assert sorted(loaded.structure.ops) == RUNS
    assert loaded.structure.ops == plan.structure.ops
    assert loaded.structure.owner == plan.structure.owner
    assert loaded.block_policies == plan.block_policies
    assert loaded.schedule.peak == plan.schedule.peak
    model = loaded.apply(copy.deepcopy(base))
    torch.manual_seed(7)
    model(x, y).backward()
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), expected))


def test_compile_blocks_refuses_a_shared_module(planned):
    base, _, plan, _ = planned
    with pytest.raises(RematError, match="'layer' runs several times"):
        plan.compile_blocks(copy.deepcopy(base))
