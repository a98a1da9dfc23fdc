"""A compiled plan's graph in Inductor's forms (remat.fx_passes.tracing.inductor_forms): ReLU's
backward reads a bool mask made in the forward, max-pooling keeps int8 offsets, and neither
backward reads the activation itself. Checked on the U-Net of tests.models against the graph
as captured without the forms, and against eager PyTorch's gradients, op by op (no compile)
and once under Inductor with the layout optimization a convolutional graph keeps."""
from __future__ import annotations

import copy

import pytest
import torch
from torch._inductor.decomposition import select_decomp_table

import remat
from remat.fx_passes.compiled.inductor import conv_heavy
from remat.fx_passes.compiled.planned import planned_module
from remat.fx_passes.lowering.lower import lower
from remat.fx_passes.measuring.allocator import step_peak
from remat.fx_passes.tracing.capture import capture
from remat.solvers import SolverOptions, simulate, solve
from remat.solvers.core.problem import Phase
from remat.solvers.timeline.evaluate import make_schedule
from tests import models
from tests.gradients import CHANNELS_LAST_SUMS, REORDERED_SUMS, relative_grad_gap


def unet():
    return models.unet(batch=2, size=16)


def lowered(inductor: bool):
    model, inputs = unet()
    return lower(capture(model, inputs, inductor=inductor))


def backward_readers(problem, name: str) -> list[str]:
    i = [op.name for op in problem.ops].index(name)
    return [problem.ops[j].name for j in problem.users[i] if j >= problem.num_forward]


def test_pooled_relu_outputs_leave_the_backward_for_masks_and_offsets():
    plain, forms = lowered(False), lowered(True)
    assert forms.source.get("inductor_forms") and not plain.source.get("inductor_forms")
    # relu_1 is the first level's output: pooled, and concatenated into the decoder's input.
    # Captured as is, the pool's backward reads it, and ReLU's through a detach; in
    # Inductor's forms neither, where this torch's Inductor decomposes the pool's backward as
    # a scatter_add of the gradient (torch 2.13; on 2.11 Inductor's backward reads the input).
    assert sorted(backward_readers(plain, "relu_1")) == ["detach_1",
                                                         "max_pool2d_with_indices_backward_1"]
    scattered = torch.ops.aten.max_pool2d_with_indices_backward.default in select_decomp_table()
    assert backward_readers(forms, "relu_1") == \
        ([] if scattered else ["max_pool2d_with_indices_backward_1"])
    relu = {op.name: op for op in forms.ops}["relu_1"]
    masks = [op for op in forms.ops if op.target == "aten.le.Scalar"]
    assert len(masks) == sum(op.target == "aten.relu.default" for op in forms.ops)
    assert all(op.phase is Phase.FORWARD for op in masks)
    mask = next(op for op in masks if forms.ops[op.inputs[0]].name == "relu_1")
    assert mask.size * 4 == relu.size  # a byte per float32 element
    # The argmax in int8 (the pool's second output), an eighth of int64 indices.
    pools = [i for i, op in enumerate(forms.ops) if "with_offsets" in op.target]
    assert len(pools) == 2
    for i in pools:
        values, offsets = (forms.ops[j] for j in sorted(forms.users[i]))
        assert offsets.size * 4 == values.size
    # What the backward is handed falls: the captured graph's plan that recomputes nothing
    # (save-all) peaks higher than the forms' plan that recomputes only the masks of the
    # outputs a convolution's backward reads anyway (no FLOPs).
    redundant = {i for i in range(forms.num_forward) if forms.ops[i].target == "aten.le.Scalar"
                 and backward_readers(forms, forms.ops[forms.ops[i].inputs[0]].name)}
    assert redundant and all(forms.ops[i].flops == 0 for i in redundant)
    peaks = (simulate(plain, make_schedule(plain, (), budget=None)).peak,
             simulate(forms, make_schedule(forms, redundant, budget=None)).peak)
    assert peaks[1] < peaks[0], peaks


def test_the_forms_run_op_by_op_with_eager_gradients():
    problem = lowered(True)
    model, inputs = unet()
    # Every mask and every ReLU output recomputed where recomputable: the backward makes them
    # again from the convolutions' outputs.
    recomputed = {i for i, op in enumerate(problem.ops[:problem.num_forward])
                  if op.target in ("aten.le.Scalar", "aten.relu.default")}
    for schedule in (make_schedule(problem, (), budget=None),
                     make_schedule(problem, recomputed, budget=None)):
        eager, planned = copy.deepcopy(model), copy.deepcopy(model)
        module = planned_module(planned, problem, schedule)
        module(*inputs).backward()
        eager(*inputs).backward()
        assert relative_grad_gap(planned, eager) <= REORDERED_SUMS
        assert set(module.partition.recomputed) == {problem.ops[i].name
                                                    for i in schedule.recomputed}


def relu_of_mask(problem, mask: int) -> int:
    return problem.root[problem.ops[mask].inputs[0]]


def test_masks_are_recomputed_for_free_where_their_relu_outputs_are_saved():
    problem = lowered(True)
    masks = {i for i in range(problem.num_forward) if problem.ops[i].target == "aten.le.Scalar"}
    # Each mask's one reader, a where in ReLU's backward, computes it inside its own kernel.
    assert problem.fused_recomputations == masks
    assert set(problem.source["free_recompute"]) == {problem.ops[i].name for i in masks}
    assert all(problem.ops[i].cost == 0 and problem.source["free_recompute"][problem.ops[i].name]
               > 0 for i in masks)
    # Save-all then saves a mask only where its ReLU output is not saved (it is concatenated
    # into the decoder's input, which is saved instead).
    schedule = solve(problem, 10**12, "save_all")
    assert schedule.info["free_recomputations"] > 0
    for i in masks:
        assert (i in schedule.saved) != (relu_of_mask(problem, i) in schedule.saved)


def test_convolutional_graphs_keep_inductors_layout_optimization():
    assert conv_heavy(lowered(True))
    model, inputs = models.mlp(batch=4, width=16, depth=2)
    assert not conv_heavy(lower(capture(model, inputs, inductor=True)))


@pytest.mark.slow
def test_a_compiled_unet_plan_fits_by_the_allocator_and_trains_as_eager():
    model, inputs = unet()
    eager = copy.deepcopy(model)
    plan = remat.optimize(model, activation_budget=10**12, example_inputs=inputs,
                          compile=True, solver_options=SolverOptions(time_limit=10))
    for p in model.parameters():
        p.grad = None
    peak, loss = step_peak(lambda: plan.module(*inputs), lambda out, seed: out.backward(seed))
    del loss
    grads = sum(p.grad.untyped_storage().nbytes() for p in model.parameters())
    assert peak - grads <= plan.activation_peak
    # The plan's own compile (the step above ran it) recomputes masks for free, and saves none
    # beside the ReLU output it is computed from: on torch 2.13 it saves the masks of the two
    # ReLU outputs concatenated into the decoder; on 2.11, whose max-pooling backward reads
    # its input, those outputs are saved too, and no mask is.
    partition, ops = plan.module.partition, plan.problem.ops
    masks = [i for i, op in enumerate(ops) if op.target == "aten.le.Scalar"]
    assert any(ops[i].name in partition.recomputed for i in masks)
    assert all(ops[relu_of_mask(plan.problem, i)].name not in partition.saved
               for i in masks if ops[i].name in partition.saved)
    eager(*inputs).backward()
    assert relative_grad_gap(model, eager) <= CHANNELS_LAST_SUMS
