"""A compiled plan's loss backward read from the logits (remat.fx_passes.tracing.softmax_loss)
and the values the lowering counts as fused by Inductor (remat.fx_passes.lowering.fusion).
Checked on tests.models' GPT (cross-entropy over its vocabulary) against the graph captured
without the forms, against eager PyTorch's gradients op by op, and once under Inductor
against the allocator."""
from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch

import remat
from remat.fx_passes.compiled.planned import planned_module
from remat.fx_passes.lowering.fusion import MAX_READERS
from remat.fx_passes.lowering.lower import lower, op_nodes
from remat.fx_passes.measuring.allocator import step_peak
from remat.fx_passes.tracing.capture import capture
from remat.solvers import Problem, SolverOptions, simulate
from remat.solvers.core.problem import Phase
from remat.solvers.timeline.evaluate import make_schedule
from tests import models
from tests.gradients import REORDERED_SUMS, relative_grad_gap


def gpt(**config):
    model, (idx, targets) = models.gpt(models.GPTConfig(dropout=0.0, **config))
    targets = targets.clone()
    targets[0, :5] = -100  # ignored: the loss's mean counts the others
    return model, (idx, targets)


def only(problem, target: str) -> int:
    found = [i for i, op in enumerate(problem.ops) if op.target == target]
    assert len(found) == 1, found
    return found[0]


def backward_readers(problem, i: int) -> list[int]:
    return [j for j in problem.storage_readers[i] if j >= problem.num_forward]


def test_log_softmax_leaves_the_backward_and_is_fused():
    model, inputs = gpt()
    plain = lower(capture(model, inputs, inductor=False))
    forms = lower(capture(model, inputs, inductor=True))
    log_softmax = "aten._log_softmax.default"
    assert backward_readers(plain, only(plain, log_softmax))
    i = only(forms, log_softmax)
    assert not backward_readers(forms, i) and i not in forms.candidates
    # counted at no bytes, its bytes unfused kept for the rewrite's check against the graph
    assert forms.ops[i].size == 0
    assert forms.source["fused"][forms.ops[i].name] == plain.ops[only(plain, log_softmax)].size
    # the backward reads the logits (log-softmax's input) and a value per row instead
    logits = forms.root[forms.ops[i].inputs[0]]
    softmax_grad = forms.ops[only(forms, "aten.exp.default")]
    assert {forms.root[j] for j in forms.ops[softmax_grad.inputs[0]].inputs} >= {logits}
    assert forms.root[forms.ops[only(forms, "aten.nll_loss_backward.default")].inputs[0]] \
        == logits
    lse = forms.ops[only(forms, "aten.logsumexp.default")]
    assert lse.phase is Phase.FORWARD and lse.size * 128 == forms.ops[logits].size


def test_fused_values_follow_the_rule():
    """Every fused value is read in its own phase only, by at most MAX_READERS pointwise or
    reduction ops; no value a matmul reads is fused; both phases have some."""
    model, inputs = gpt()
    captured = capture(model, inputs, inductor=True)
    problem = lower(captured)
    nodes = op_nodes(captured, problem)
    fused = [problem.index(name) for name in problem.source["fused"]]
    assert {problem.ops[i].phase for i in fused} == {Phase.FORWARD, Phase.BACKWARD}
    inline = (torch.Tag.pointwise, torch.Tag.reduction)
    for i in fused:
        readers = problem.storage_readers[i]
        assert 0 < len(readers) <= MAX_READERS and i not in problem.candidates
        assert all(problem.ops[j].phase is problem.ops[i].phase for j in readers)
        assert all(any(t in nodes[j].target.tags for t in inline)
                   or "softmax" in problem.ops[j].target or "nll_loss" in problem.ops[j].target
                   for j in readers), [problem.ops[j].target for j in readers]
    matmul_inputs = {problem.root[j] for op in problem.ops if op.target == "aten.mm.default"
                     for j in op.inputs}
    assert not matmul_inputs & set(fused)


def test_the_forms_run_op_by_op_with_eager_gradients():
    model, inputs = gpt()
    problem = lower(capture(model, inputs, inductor=True))
    # the logits recomputed (the head's matmul again in the backward), or saved
    head = {i for i in problem.candidates if problem.ops[i].target == "aten.mm.default"}
    for schedule in (make_schedule(problem, (), budget=None),
                     make_schedule(problem, {max(head)}, budget=None)):
        eager, planned = copy.deepcopy(model), copy.deepcopy(model)
        module = planned_module(planned, problem, schedule)
        loss = module(*inputs)
        loss.backward()
        expected = eager(*inputs)
        expected.backward()
        assert torch.allclose(loss, expected)
        assert relative_grad_gap(planned, eager) <= REORDERED_SUMS


def unfused(problem: Problem) -> Problem:
    sizes = problem.source["fused"]
    return replace(problem, ops=tuple(replace(op, size=sizes.get(op.name, op.size))
                                      for op in problem.ops))


@pytest.mark.slow
def test_the_fused_simulation_is_nearer_inductors_allocator():
    """A save-all plan compiled by Inductor: the allocator's activation peak is nearer the
    simulation with fused values at no bytes than the one that counts them (on this GPT,
    whose loss region holds logits-sized tensors, the unfused one is far above)."""
    model, inputs = gpt(vocab_size=1024, block_size=64)
    plan = remat.optimize(model, activation_budget=10**12, example_inputs=inputs,
                          compile=True, solver="save_all",
                          solver_options=SolverOptions(time_limit=10))
    for p in model.parameters():
        p.grad = None
    peak, loss = step_peak(lambda: plan.module(*inputs), lambda out, seed: out.backward(seed))
    del loss
    measured = peak - sum(p.grad.untyped_storage().nbytes() for p in model.parameters())
    problem = plan.prepared.problem
    fused = plan.inductor.predicted
    counted = simulate(unfused(problem), plan.schedule).peak - (
        simulate(problem, plan.schedule).peak - fused)
    assert abs(measured - fused) < abs(measured - counted), (measured, fused, counted)
    assert counted - fused >= problem.source["fused"][
        problem.ops[only(problem, "aten._log_softmax.default")].name]


class Head(torch.nn.Module):
    """A head and a cross-entropy of the kind Hugging Face models compute (the logits made
    float32 first, the loss summed), with label smoothing: log-softmax's output also read by
    the smoothing's sum."""

    def __init__(self, reduction: str, smoothing: float):
        super().__init__()
        self.head = torch.nn.Linear(16, 64)
        self.reduction, self.smoothing = reduction, smoothing

    def forward(self, x, targets):
        logits = self.head(torch.tanh(x)).float()
        return torch.nn.functional.cross_entropy(
            logits.view(-1, 64), targets.view(-1), reduction=self.reduction,
            label_smoothing=self.smoothing)


@pytest.mark.parametrize("reduction,smoothing", [("sum", 0.0), ("mean", 0.1)])
def test_other_cross_entropies_keep_eager_gradients(reduction, smoothing):
    torch.manual_seed(0)
    model = Head(reduction, smoothing)
    x, targets = torch.randn(4, 8, 16), torch.randint(0, 64, (4, 8))
    targets[0, :3] = -100
    problem = lower(capture(model, (x, targets), inductor=True))
    assert "aten._log_softmax_backward_data.default" not in [op.target for op in problem.ops]
    eager, planned = copy.deepcopy(model), copy.deepcopy(model)
    module = planned_module(planned, problem, make_schedule(problem, (), budget=None))
    module(x, targets).backward()
    eager(x, targets).backward()
    assert relative_grad_gap(planned, eager) <= REORDERED_SUMS
