"""`Training(tensor_parallel=N, sequence_parallel=...)` and `remat.optimize` on a DTensor model,
in one process: the tests' Llama parallelized on `fake_tensor_parallel` (a fake process group,
no job). The layout is read from the model (`remat.planner.job.tensor_layout`) and checked
against what `Training` states; a model without DTensor parameters is never planned as if it
were tensor-parallel; `optimize(..., execution="eager")` plans one TP rank as
`plan_tensor_parallel` does, and a compiled plan of such a model is refused."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import remat
from examples.llama import LLAMA_TEST, llama
from examples.llama_tensor_parallel import parallelize_llama
from remat.planner.job.tensor_layout import tensor_layout
from remat.planner.parallel.tensor_parallel import (TensorParallelPlan, fake_tensor_parallel,
                                           plan_tensor_parallel, prepare_tensor_parallel)

CONFIG = LLAMA_TEST
BATCH = 2


def test_training_states_tensor_and_sequence_parallel():
    t = remat.Training(tensor_parallel=4, sequence_parallel=True)
    assert t.to_dict()["tensor_parallel"] == 4 and t.to_dict()["sequence_parallel"] is True
    assert remat.Training().tensor_parallel is None  # as the model is parallelized
    for bad in (0, -2, 1.5, True, "2"):
        with pytest.raises(ValueError, match="tensor_parallel must be an int"):
            remat.Training(tensor_parallel=bad)
    with pytest.raises(ValueError, match="sequence_parallel must be"):
        remat.Training(sequence_parallel="yes")
    with pytest.raises(ValueError, match="needs tensor_parallel > 1"):
        remat.Training(tensor_parallel=1, sequence_parallel=True)


@pytest.mark.parametrize("execution", ["eager", "compiled"])
def test_tensor_parallel_without_dtensor_is_refused_with_the_remedy(execution):
    model, inputs = llama(CONFIG, batch=BATCH, data_seed=1)
    with pytest.raises(remat.RematError) as e:
        remat.optimize(model, activation_budget="1MB", example_inputs=inputs,
                       training=remat.Training(tensor_parallel=2), execution=execution)
    message = str(e.value)
    assert "no DTensor parameter" in message and "parallelize_module" in message
    assert "fake_tensor_parallel(2)" in message, message
    # Not tensor-parallel, said so or left to the model: planned as usual.
    plain = remat.optimize(model, activation_budget=10**9, example_inputs=inputs,
                           training=remat.Training(tensor_parallel=1), execution="eager")
    assert not isinstance(plain, TensorParallelPlan)


def test_the_layout_is_read_from_the_placements_and_checked():
    model, inputs = llama(CONFIG, batch=BATCH, data_seed=1)
    assert tensor_layout(model) == tensor_layout(model).__class__(1, False, {})
    for sequence_parallel in (False, True):
        with fake_tensor_parallel(2) as mesh:
            model, inputs = llama(CONFIG, batch=BATCH, data_seed=1)
            parallelize_llama(model, mesh, sequence_parallel=sequence_parallel)
            layout = tensor_layout(model)
            assert (layout.size, layout.sequence_parallel) == (2, sequence_parallel)
            assert layout.placements["layers.0.feed_forward.w2.weight"] == "(Shard(dim=1),)"
            other = not sequence_parallel
            for training, match in (
                    (remat.Training(tensor_parallel=4), "mesh of 2 ranks"),
                    (remat.Training(tensor_parallel=2, sequence_parallel=other),
                     f"sequence_parallel={other}")):
                with pytest.raises(remat.RematError, match=match):
                    remat.optimize(model, activation_budget="1MB", example_inputs=inputs,
                                   training=training, execution="eager")
                with pytest.raises(remat.RematError, match=match):
                    plan_tensor_parallel(model, activation_budget="1MB",
                                         example_inputs=inputs, training=training)
            with pytest.raises(remat.RematError, match="execution=\"eager\""):
                remat.optimize(model, activation_budget="1MB", example_inputs=inputs,
                               training=remat.Training(tensor_parallel=2))


def test_a_fully_sharded_model_is_not_taken_for_tensor_parallel():
    """FSDP2's parameters are DTensors on the data-parallel mesh: refused, with the remedy
    (plan before fully_shard), not planned as TP."""
    from torch.distributed.fsdp import fully_shard

    with fake_tensor_parallel(2) as mesh:
        model, inputs = llama(CONFIG, batch=BATCH, data_seed=1)
        fully_shard(model, mesh=mesh)
        with pytest.raises(remat.RematError, match="already fully_shard-ed"):
            remat.optimize(model, activation_budget="1MB", example_inputs=inputs,
                           execution="eager")


def unnamed(problem) -> tuple:
    """`problem`'s fields, the names of its ops left out (of the ops, and of the parameter
    gradients its `source` lists)."""
    def without_names(name, value):
        if name == "ops":
            return tuple(dataclasses.replace(op, name="") for op in value)
        if name == "source":
            return {k: v for k, v in value.items() if k != "param_gradients"}
        return value

    return tuple(without_names(f.name, getattr(problem, f.name))
                 for f in dataclasses.fields(problem))


def test_optimize_plans_a_tensor_parallel_rank_as_plan_tensor_parallel_does():
    """The same model, budget and training through both entry points: the same plan (the
    TP corrections included: collectives recomputable, re-communicated by the plan)."""
    training = remat.Training(tensor_parallel=2, sequence_parallel=True, reserve=0,
                              fragmentation=0.01)
    with fake_tensor_parallel(2) as mesh:
        model, inputs = llama(CONFIG, batch=BATCH, data_seed=1)
        parallelize_llama(model, mesh, sequence_parallel=True)
        args = dict(example_inputs=inputs, training=training)
        prepared = prepare_tensor_parallel(model, inputs, training=training)
        everything = plan_tensor_parallel(model, activation_budget=10**9, prepared=prepared,
                                          **args).memory
        budget = int((everything.static + 0.6 * everything.activation_peak) / 0.99)
        direct = plan_tensor_parallel(model, budget, prepared=prepared, **args)
        routed = remat.optimize(model, budget, execution="eager", **args)
    assert isinstance(routed, TensorParallelPlan)
    assert routed.recompute_flops > 0 and direct.recompute_flops > 0
    assert routed.peak <= budget and direct.peak <= budget  # the margin included
    # The same problem: the same state, eager timeline and blocks. The plans themselves may
    # differ where the eager search is cut by its wall-clock limit (a loaded machine) or
    # between plans of equal cost; where both are proven, their costs are one.
    assert routed.memory.static == direct.memory.static
    # Op names are labels: torch 2.11's second capture numbers some nodes on (view_58 for
    # view_57); what each op is, reads and costs is the same.
    assert unnamed(routed.plan.eager_problem) == unnamed(direct.plan.eager_problem)
    assert routed.block_policies.keys() == direct.block_policies.keys()
    if routed.status.value == direct.status.value == "OPTIMAL":
        assert routed.schedule.cost == pytest.approx(direct.schedule.cost, rel=1e-3)
    kinds = {name.rstrip("_0123456789") for name, _, _ in routed.collectives}
    assert {"all_gather_into_tensor", "reduce_scatter_tensor"} <= kinds, kinds
    # The rest of an eager plan reads through (its report, its activation peak).
    assert routed.activation_peak == routed.plan.activation_peak
    assert routed.placements["tok_embeddings.weight"] == "(Shard(dim=0),)"


def test_fsdp_inside_pipeline_stages_terms():
    """remat.planner.parallel.fsdp: the units of a stage (root first, blocks in order), the
    end-of-step reduction's peak replayed by hand, and what is refused."""
    from dataclasses import replace

    from examples.llama_pipeline import llama_stages
    from remat.planner.parallel.fsdp import (StageUnits, check_fsdp_in_pipeline, reduce_peak,
                                             stage_units)

    config = replace(CONFIG, layers=4)
    model, _ = llama(config, batch=BATCH, data_seed=1)
    first, last = llama_stages(model, 2)
    training = remat.Training(data_parallel=2, zero_stage=3, reshard_after_forward=False)
    units = stage_units(last, training)
    layer = sum(p.numel() for p in model.layers[2].parameters()) * 4
    rest = (model.norm.weight.numel() + model.output.weight.numel()) * 4
    assert units.params == units.grads == units.padded == (rest, layer, layer)
    # Root: its parameters resharded, its buffer and shard made while every gradient lives.
    u = StageUnits(params=(10, 20, 30), grads=(10, 20, 30), padded=(12, 20, 30))
    steps = [50 + 60 + 0 + 12 + 6, 30 + 50 + 6 + 20 + 10, 0 + 30 + 16 + 30 + 15]
    assert reduce_peak([u], 2) == max(steps) == 128
    for bad in (remat.Training(data_parallel=2, zero_stage=3),
                remat.Training(data_parallel=2, zero_stage=2)):
        with pytest.raises(remat.RematError, match="reshard_after_forward=False"):
            check_fsdp_in_pipeline(bad, split_backward=False)
    with pytest.raises(remat.RematError, match="zero-bubble"):
        check_fsdp_in_pipeline(training, split_backward=True)
    check_fsdp_in_pipeline(remat.Training(), split_backward=True)  # no sharding: nothing


class _RowParallelBias(torch.nn.Module):
    """A column-parallel Linear, then a row-parallel one with a bias, then ``x * 0.5``."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.up = torch.nn.Linear(width, 2 * width)
        self.down = torch.nn.Linear(2 * width, width)

    def forward(self, x):
        return (self.down(torch.relu(self.up(x))) * 0.5).square().mean()


def test_a_row_parallel_bias_keeps_no_number():
    """DTensor makes a row-parallel Linear's replicated bias partial with ``bias / N`` on the
    local tensor, under the Linear's AddmmBackward0, whose backward reads no number: nothing
    keeps the number eager wraps it in (measured: a GPT-style model's no-checkpoint step 8
    bytes a row-parallel bias above the allocator before). ``x * 0.5``'s is kept by its node."""
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    from remat.planner.plans.eager_plan import eager_structure

    torch.manual_seed(0)
    with fake_tensor_parallel(2) as mesh:
        model = parallelize_module(_RowParallelBias(), mesh,
                                   {"up": ColwiseParallel(), "down": RowwiseParallel()})
        inputs = (torch.randn(4, 16),)
        prepared = prepare_tensor_parallel(model, inputs, training=remat.Training())
        problem, structure, _, _ = eager_structure(model, prepared, [], inputs)
    kept = [problem.ops[v].target for _, v, _ in structure.kept_numbers]
    divided = [op.target for op in problem.ops[:problem.num_forward]
               if op.target == "aten.div.Tensor"]
    assert divided and kept == ["aten.mul.Tensor"], (divided, kept)
