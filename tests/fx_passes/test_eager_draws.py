"""Random draws in an eager plan. Checkpoint replays the generator from a block's start, so a
recomputed draw takes the numbers of the first draw the recomputation makes: a block's draws
are cached all or none, and the gradients equal eager PyTorch's at every budget. A plan made
for torch.compile caches every draw, as the traced policy does.

The blocks draw with ``rand_like`` and ``randn_like``: functional random ops, as dropout is on
CUDA (``native_dropout``). On the CPU dropout draws with an in-place ``bernoulli_``, which no
policy caches: a block that has one recomputes every draw."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import remat
from remat.errors import BudgetError
from remat.fx_passes.eager.call_guard import current
from remat.planner.plans.eager_plan import plan_eager_mode
from remat.planner.plans.prepare import prepare
from remat.solvers import SolverOptions, Strategy

DRAWS = ("aten.rand_like.default", "aten.randn_like.default")
OPTIONS = SolverOptions(time_limit=20, deterministic=True)


class Noisy(nn.Module):
    def __init__(self, width: int = 64):
        super().__init__()
        self.a, self.b = nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x):
        h = torch.tanh(self.a(x) * torch.rand_like(x))
        return torch.tanh(self.b(h) * torch.randn_like(h))


class NoisyDropout(Noisy):
    """A functional draw, then dropout's in-place one."""

    def __init__(self, width: int = 64):
        super().__init__(width)
        self.drop = nn.Dropout(0.2)

    def forward(self, x):
        h = self.drop(torch.tanh(self.a(x) * torch.rand_like(x)))
        return torch.tanh(self.b(h))


class Stack(nn.Module):
    def __init__(self, block=Noisy):
        super().__init__()
        self.blocks = nn.ModuleList([block(), block()])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x.square().mean()


@pytest.fixture(scope="module")
def stack():
    torch.manual_seed(0)
    return Stack(), torch.randn(32, 64)


def gradients_at_budgets(model, x) -> list[dict[str, set[str]]]:
    """Plans at fractions of the save-all peak, each run against eager PyTorch's gradients
    (same seed); each plan's cached draws."""
    reference = grads(copy.deepcopy(model), x)
    full = remat.optimize(copy.deepcopy(model), activation_budget=10**9, example_inputs=(x,),
                          execution="eager").activation_peak
    seen = []
    for fraction in (0.3, 0.45, 0.6, 0.7, 0.8, 0.9):
        try:
            plan = remat.optimize(copy.deepcopy(model), activation_budget=int(full * fraction),
                                  example_inputs=(x,), execution="eager",
                                  solver_options=OPTIONS)
        except BudgetError:
            continue
        seen.append(cached_draws(plan))
        applied = plan.apply(copy.deepcopy(model))
        for got, want in zip(grads(applied, x), reference):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7, msg=str(fraction))
    return seen


def grads(model, x):
    torch.manual_seed(1)
    model(x).backward()
    return [p.grad.clone() for p in model.parameters()]


def cached_draws(plan) -> dict[str, set[str]]:
    """Per block, the random ops its policy caches."""
    out = {}
    for path, planned in plan.block_policies.items():
        policy = current(planned)
        out[path] = {policy.ops[k] for k in policy.cache if policy.ops[k] in DRAWS}
    return out


def test_a_blocks_draws_are_cached_together_and_gradients_equal_eagers(stack):
    model, x = stack
    plans = gradients_at_budgets(model, x)
    assert all(drawn in (set(), set(DRAWS)) for plan in plans for drawn in plan.values())
    # plans that recompute the draws and plans that cache them: the check can tell
    assert {len(drawn) for plan in plans for drawn in plan.values()} == {0, 2}


def test_a_block_with_an_in_place_draw_recomputes_every_draw():
    torch.manual_seed(0)
    plans = gradients_at_budgets(Stack(NoisyDropout), torch.randn(32, 64))
    assert len(plans) >= 3
    assert all(drawn == set() for plan in plans for drawn in plan.values())


def test_a_plan_for_torch_compile_caches_every_draw(stack):
    """The traced policy caches every op that draws (recomputed under tracing on the CPU it
    would draw anew); the plan made for torch.compile does too, at the least budget as well."""
    model, x = stack
    prepared = prepare(model, (x,))

    def plan(for_compile: bool):
        return plan_eager_mode(model, prepared, budget=None, activation_budget=1,
                               target="h100", solver=Strategy.OPTIMAL, solver_options=OPTIONS,
                               blocks=None, example_inputs=(x,), for_compile=for_compile)

    def least(for_compile: bool):
        try:
            plan(for_compile)
        except BudgetError as e:
            return e.smallest
        raise AssertionError("a 1-byte budget was met")

    for_compile = plan_eager_mode(model, prepared, budget=None,
                                  activation_budget=least(True), target="h100",
                                  solver=Strategy.OPTIMAL, solver_options=OPTIONS, blocks=None,
                                  example_inputs=(x,), for_compile=True)
    assert all(drawn == set(DRAWS) for drawn in cached_draws(for_compile).values())
    plain = plan_eager_mode(model, prepared, budget=None, activation_budget=least(False),
                            target="h100", solver=Strategy.OPTIMAL, solver_options=OPTIONS,
                            blocks=None, example_inputs=(x,))
    assert all(drawn == set() for drawn in cached_draws(plain).values())
