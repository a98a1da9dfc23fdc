"""One meaning of "activations": the step's peak less the state (parameters, their gradients as
`.grad` holds them, master weights, optimizer state). Checked against the CPU allocator."""
import torch
import torch.nn as nn
import torch.nn.functional as F

import remat
from remat.planner.job.training import Training
from remat.planner.plans.plan import plan_prepared
from remat.planner.plans.prepare import prepare
from remat.solvers import SolverOptions, Strategy
from tests.allocator import allocator_peak, storage_bytes

STATE_ONLY = Training(optimizer="sgd", reserve=0, fragmentation=0.0)  # state: weights + grads


class WideResidualMLP(nn.Module):
    """Wide square layers on a small batch: 16 MiB of gradients, a fraction of it in
    activations."""

    def __init__(self, width=512, depth=4):
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, width))
            for _ in range(depth))

    def forward(self, x, target):
        for block in self.blocks:
            x = x + block(x)
        return F.mse_loss(x, target)


def wide_mlp():
    torch.manual_seed(0)
    model = WideResidualMLP().train()
    g = torch.Generator().manual_seed(1)
    return model, (torch.randn(64, 512, generator=g), torch.randn(64, 512, generator=g))


def measured_step(plan, model, inputs) -> int:
    """The whole step's peak as the allocator sees it: the parameters, buffers and batch
    (allocated before) and the step's allocations; gradients start as None, as after
    zero_grad()."""
    module = plan.module
    module(*inputs).backward()  # compile outside the measurement
    model.zero_grad(set_to_none=True)
    peak, _ = allocator_peak(lambda: module(*inputs).backward())
    held = [*model.parameters(), *model.buffers(),
            *(x for x in inputs if isinstance(x, torch.Tensor))]
    return storage_bytes(held) + peak


def test_gradients_larger_than_the_activations_plan_below_their_bytes():
    """The gradients are state, not activations: counted inside the activations, every activation
    budget would raise BudgetError on such a model (its smallest "activation" peak would be all
    its gradients)."""
    model, inputs = wide_mlp()
    grads = sum(p.numel() * 4 for p in model.parameters())
    prepared = prepare(model, inputs, training=STATE_ONLY)
    save_all = prepared.step_memory(prepared.baselines[Strategy.SAVE_ALL], None)
    budget = 2 * save_all.activation_peak
    assert budget < grads // 4  # the model this test is about
    assert save_all.simulated_peak > grads  # what the old meaning bounded
    plan = plan_prepared(model, prepared, budget=None, activation_budget=budget, target="h100",
                         solver_options=SolverOptions(time_limit=2))
    assert plan.activation_peak <= budget < grads
    assert plan.memory.state.gradients == grads == plan.prepared.graph_gradients
    # The report's terms add up, and the activation budget adds no reserve.
    rows = {name: (size, counted) for name, size, counted, _ in plan.memory.rows()}
    assert rows["activation peak"] == (plan.activation_peak, True)
    assert sum(size for size, counted in rows.values() if counted) == plan.peak
    measured = measured_step(plan, model, inputs)
    state = plan.memory.state.total
    assert abs(measured - (plan.activation_peak + state)) <= 0.01 * measured


def test_activation_peak_plus_state_is_the_allocators_whole_step_peak():
    from tests.models import gpt, GPTConfig

    config = GPTConfig(block_size=64, vocab_size=256, n_layer=2, n_head=4, n_embd=64,
                       dropout=0.0)
    model, inputs = gpt(config, batch=4)
    plan = remat.optimize(model, activation_budget=10**12, example_inputs=inputs,
                          training=STATE_ONLY, solver="save_all")
    measured = measured_step(plan, model, inputs)
    predicted = plan.activation_peak + plan.memory.state.total
    assert predicted == plan.peak
    assert abs(measured - predicted) <= 0.02 * measured, (measured, predicted)
