"""The allocator's peak is the contract: kernel scratch is measured into `Op.temp`, and the
rewritten step's allocator peak (torch.profiler memory events on the CPU) is at most the
simulated peak and within 2 % of it. `measure_step` reads that peak without changing it."""
from __future__ import annotations

import copy
import functools
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from remat.errors import BudgetError
from remat.fx_passes import capture, lower
from remat.fx_passes.measuring.allocator import AllocatorTrace, allocator_peak, step_peak
from remat.fx_passes.measuring.flops import FlopCounter
from remat.fx_passes.compiled.measure_step import measure_step
from remat.fx_passes.compiled.planned import planned_module
from remat.fx_passes.measuring.storage import remat_meta
from remat.fx_passes.measuring.workspace import workspace_bytes
from remat.solvers import SolverOptions, make_schedule, simulate, solve


class ConvNet(nn.Module):
    """A small U-Net: Conv2d, BatchNorm, ReLU(inplace=True), a skip joined by cat."""

    def __init__(self, c=8):
        super().__init__()
        self.down = nn.Sequential(nn.Conv2d(3, c, 3, padding=1), nn.BatchNorm2d(c),
                                  nn.ReLU(inplace=True))
        self.mid = nn.Sequential(nn.Conv2d(c, 2 * c, 3, stride=2, padding=1),
                                 nn.BatchNorm2d(2 * c), nn.ReLU(inplace=True),
                                 nn.ConvTranspose2d(2 * c, c, 2, stride=2))
        self.out = nn.Sequential(nn.Conv2d(2 * c, c, 3, padding=1), nn.ReLU(inplace=True),
                                 nn.Conv2d(c, 1, 1))

    def forward(self, x, target):
        skip = self.down(x)
        return F.mse_loss(self.out(torch.cat([self.mid(skip), skip], dim=1)), target)


def conv_net():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    return ConvNet().train(), (torch.randn(2, 3, 32, 32, generator=g),
                               torch.randn(2, 1, 32, 32, generator=g))


class SwiGLU(nn.Module):
    """Llama's feed-forward (silu, whose backward FlopCounterMode decomposes) with dropout."""

    def __init__(self, dim=64, hidden=172, depth=2):
        super().__init__()
        self.layers = nn.ModuleList(nn.ModuleDict({"w1": nn.Linear(dim, hidden, bias=False),
                                                   "w3": nn.Linear(dim, hidden, bias=False),
                                                   "w2": nn.Linear(hidden, dim, bias=False)})
                                    for _ in range(depth))
        self.drop = nn.Dropout(0.1)

    def forward(self, x, target):
        for f in self.layers:
            x = x + self.drop(f["w2"](F.silu(f["w1"](x)) * f["w3"](x)))
        return F.mse_loss(x, target)


def swiglu():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    return SwiGLU().train(), (torch.randn(4, 32, 64, generator=g),
                              torch.randn(4, 32, 64, generator=g))


FACTORIES = {"conv_net": conv_net, "swiglu": swiglu}


@pytest.fixture(autouse=True, scope="module")
def every_core():
    """oneDNN's convolution backward takes scratch per thread, which these tests measure: with
    the suite's one thread per xdist worker (conftest.py) it takes none. They run as a user's
    process does, on every core (at least two)."""
    before = torch.get_num_threads()
    torch.set_num_threads(max(2, os.cpu_count() or 2))
    yield
    torch.set_num_threads(before)


@functools.cache
def lowered(name):
    model, inputs = FACTORIES[name]()
    captured = capture(model, inputs)
    return model, inputs, captured, lower(captured)


@functools.cache
def plan(name, fraction):
    """The optimal schedule at `fraction` of the save-all peak (or the least that fits)."""
    problem = lowered(name)[3]
    full = simulate(problem, make_schedule(problem, ())).peak
    options = SolverOptions(time_limit=5, workers=1)
    try:
        return solve(problem, int(full * fraction), "optimal", options)
    except BudgetError as e:
        return solve(problem, e.smallest, "optimal", options)


def planned_allocator_peak(model, inputs, problem, schedule):
    """The allocator's peak of the rewritten step, uninstrumented, after a compiling step."""
    model = copy.deepcopy(model)
    module = planned_module(model, problem, schedule)
    module(*inputs).backward()
    model.zero_grad(set_to_none=True)
    peak, _ = step_peak(lambda: module(*inputs), lambda out, seed: out.backward(seed))
    return peak, module


def test_allocator_trace_and_peak():
    assert AllocatorTrace((10, 5, -10, 20, -25)).peak == 25
    assert AllocatorTrace((10, 5, -10, 20, -25)).end == 0

    def step():
        scratch = torch.empty(2**20, dtype=torch.uint8)
        kept = torch.empty(1000, dtype=torch.uint8)
        del scratch
        return kept

    assert allocator_peak(step) == 2**20 + 1000


def test_conv_backward_scratch_is_measured():
    """oneDNN's convolution backward allocates scratch that no dispatch mode sees: measured,
    it becomes the op's temp; the workspace model (for meta capture) errs high on every op."""
    _, _, captured, problem = lowered("conv_net")
    conv_backward = [n for n in captured.graph.nodes
                     if str(n.target) == "aten.convolution_backward.default"]
    assert conv_backward
    for node in conv_backward:
        meta = remat_meta(node)
        assert meta["scratch_source"] == "measured" and meta["scratch"] > 0
        op = next(o for o in problem.ops if o.name == node.name)
        assert op.temp == meta["tuple_bytes"] + meta["scratch"]
    for node in captured.graph.nodes:
        meta = remat_meta(node)
        if meta.get("scratch_source") == "measured":
            assert workspace_bytes(node) >= meta["scratch"], node.name


@pytest.mark.parametrize("name", ["conv_net", "swiglu"])
@pytest.mark.parametrize("fraction", [1.0, 0.6])
def test_allocator_peak_within_two_percent_under_simulated(name, fraction):
    """(test_rewrite checks the same, to the byte, through measure_step on the test models.)"""
    model, inputs, _, problem = lowered(name)
    schedule = plan(name, fraction) if fraction < 1 else make_schedule(problem, ())
    simulated = simulate(problem, schedule).peak
    measured, _ = planned_allocator_peak(model, inputs, problem, schedule)
    assert 0.98 * simulated <= measured <= simulated, (measured, simulated)


def test_without_scratch_the_simulator_reads_under_the_allocator():
    """The check above can fail: without the measured scratch, the simulated peak of the conv
    net is under the allocator's (the issue's U-Net was 26 % over its budget)."""
    from dataclasses import replace

    from remat.fx_passes import op_nodes
    from remat.solvers import Problem

    model, inputs, captured, problem = lowered("conv_net")
    schedule = make_schedule(problem, ())
    bare = Problem(tuple(replace(op, temp=op.temp - remat_meta(node).get("scratch", 0))
                         for op, node in zip(problem.ops, op_nodes(captured, problem))),
                   name=problem.name)
    measured, _ = planned_allocator_peak(model, inputs, problem, schedule)
    assert simulate(bare, schedule).peak < measured


@pytest.mark.parametrize("name", ["swiglu", "conv_net"])
def test_measure_step_reads_the_allocator_peak_unchanged(name):
    """Measured with its tracker and FLOP counter inside the graphs, the step peaks where it
    peaks uninstrumented (within 1 %), and the FLOPs are the plan's."""
    model, inputs, _, problem = lowered(name)
    schedule = plan(name, 0.6)
    plain, _ = planned_allocator_peak(model, inputs, problem, schedule)
    instrumented = copy.deepcopy(model)
    module = planned_module(instrumented, problem, schedule)
    module(*inputs).backward()
    instrumented.zero_grad(set_to_none=True)
    measured = measure_step(module, inputs)
    assert measured.forward_calls == 1 and measured.backward_calls == 1
    assert abs(measured.peak - plain) <= 0.01 * plain, (measured.peak, plain)
    # Every recomputation counted: in the forward, and second ones (the rich model's) too.
    assert measured.flops == problem.total_flops + schedule.recompute_flops


def test_flop_counter_counts_without_decomposing():
    """FlopCounterMode runs silu_backward as pieces that allocate; FlopCounter runs it whole."""
    grad, x = torch.randn(256, 1024), torch.randn(256, 1024)
    silu_backward = lambda: torch.ops.aten.silu_backward(grad, x)
    plain = allocator_peak(silu_backward)
    with FlopCounter():
        counted = allocator_peak(silu_backward)
    with FlopCounterMode(display=False):
        decomposed = allocator_peak(silu_backward)
    assert counted == plain == grad.numel() * 4
    assert decomposed > plain
    a, b = torch.randn(8, 16), torch.randn(16, 4)
    with FlopCounter() as counter:
        torch.mm(a, b)
    assert counter.total == 2 * 8 * 16 * 4
