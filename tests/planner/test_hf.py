"""Hugging Face models as they are: keyword inputs (labels included), the model's own output
back from the planned module, `.loss.backward()` running the plan, gradients equal to eager's
with dropout on. Tiny configurations from examples/hf_zoo.py, nothing downloaded."""
import copy

import pytest
import torch

import remat
from examples.hf_zoo import build
from remat.solvers import Strategy


def plan_and_compare(name: str):
    model, kwargs = build(name)
    eager, planned = copy.deepcopy(model), copy.deepcopy(model)
    plan = remat.optimize(planned, activation_budget=10**9, example_kwargs=kwargs,
                          solver="checkpoint_blocks")
    # checkpointing every block recomputes inside every block, dropout included
    assert plan.schedule.strategy == Strategy.CHECKPOINT_BLOCKS.value
    assert plan.recompute_flops > 0
    torch.manual_seed(11)
    out = plan.module(**kwargs)
    out.loss.backward()
    torch.manual_seed(11)
    expected = eager(**kwargs)
    expected.loss.backward()
    assert type(out) is type(expected)  # the model's own ModelOutput, not a wrapper's
    assert torch.equal(out.loss, expected.loss) and torch.equal(out.logits, expected.logits)
    assert not out.logits.requires_grad  # detached: the plan's backward starts from the loss
    for (n, a), (_, b) in zip(eager.named_parameters(), planned.named_parameters()):
        assert (a.grad is None) == (b.grad is None), n
        if a.grad is not None:
            assert (a.grad - b.grad).abs().max() <= 1e-6 * max(a.grad.abs().max(), 1e-30), n
    return plan


def test_gpt2_with_labels_as_a_keyword():
    plan = plan_and_compare("gpt2")
    assert "input_ids" in plan.prepared.kwargs and "labels" in plan.prepared.kwargs


@pytest.mark.slow
def test_llama_with_labels_as_a_keyword():
    plan_and_compare("llama")


def test_sweep_and_max_batch_take_keyword_inputs():
    """A Hugging Face model is called with keywords: sweep takes `example_kwargs` and
    max_batch `make_kwargs(n)`, as optimize takes `example_kwargs`."""
    model, kwargs = build("gpt2")
    result = remat.sweep(model, ["2GB", "3GB"], example_kwargs=kwargs,
                         solver="checkpoint_blocks")
    assert [p.feasible for p in result.points] == [True, True]
    assert set(result.plans[0].prepared.kwargs) == set(kwargs)

    def make_kwargs(n: int) -> dict:
        ids = kwargs["input_ids"][:1].repeat(n, 1)
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}

    found = remat.max_batch(model, "2GB", make_kwargs=make_kwargs, solver="save_all", limit=4)
    assert found.micro_batch == 4 and found.tried == ((1, True), (2, True), (4, True))
    assert found.plan.prepared.kwargs["input_ids"] == ((4, kwargs["input_ids"].shape[1]),
                                                       torch.int64)
    with pytest.raises(ValueError, match="make_inputs\\(n\\).*make_kwargs\\(n\\)"):
        remat.max_batch(model, "1GB")


def test_a_model_in_eval_mode_is_planned_with_a_warning(caplog):
    """from_pretrained returns a model in eval mode: planned as it is (an evaluation step),
    the warning says so and how to plan for training, before any work."""
    import logging

    model, kwargs = build("gpt2")
    model.eval()
    with caplog.at_level(logging.WARNING, logger="remat.planner.plans.prepare"):
        plan = remat.optimize(model, activation_budget=10**9, example_kwargs=kwargs,
                              solver="checkpoint_blocks", execution="eager")
    assert plan.training_mode == "eval"
    warned = [r.getMessage() for r in caplog.records if "eval mode" in r.getMessage()]
    assert len(warned) == 1
    assert "remat.optimize: GPT2LMHeadModel is in eval mode" in warned[0]
    assert "dropout is off" in warned[0] and "call model.train() before" in warned[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="remat.planner.plans.prepare"):
        remat.optimize(model.train(), activation_budget=10**9, example_kwargs=kwargs,
                       solver="checkpoint_blocks", execution="eager")
    assert not any("eval mode" in r.getMessage() for r in caplog.records)


def test_a_range_plan_compiles_at_its_first_call_under_a_flops_profiler():
    """torch.profiler(with_flops=True) reads the sizes of every op's inputs, fake tensors
    included: tracing under it fixed the range's symbolic sizes, and the graph did not match
    the plan ("graph nodes ['add', ...] are not ops of the problem"). The compile runs
    unrecorded; the compiled graphs run recorded, their FLOPs counted."""
    from torch.profiler import ProfilerActivity, profile

    model, kwargs = build("qwen2")
    kwargs = {k: v[:2] for k, v in kwargs.items()}
    eager = copy.deepcopy(model)
    plan = remat.optimize(model, activation_budget=10**9, example_kwargs=kwargs,
                          solver="checkpoint_blocks", dynamic={"seq": (4, 7)})
    with profile(activities=[ProfilerActivity.CPU], with_flops=True) as prof:
        loss = plan.module(**kwargs).loss  # the first call: it compiles
        loss.backward()
    torch.testing.assert_close(loss, eager(**kwargs).loss)
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    counted = {e.key: e.flops for e in prof.key_averages()}
    assert counted.get("aten::mm", 0) > 0  # the planned graphs' matmuls, recorded
    with profile(activities=[ProfilerActivity.CPU]) as after:
        torch.ones(3).add(1)
    assert "aten::add" in {e.key for e in after.key_averages()}  # recording is back on


def test_a_classification_head_compiles_once():
    """Swin's classification loss sets config.problem_type at its first call. Traced with
    None, the first compiled call replayed the assignment and the second failed dynamo's
    guard and compiled the whole step again, its compile's own 24 bytes (constants of the
    drop-path divisions) inside that step's memory. The compiled step sets the problem type
    before its first call, as the model itself would: one compile, and the allocator within
    the prediction from the second step on."""
    from remat.fx_passes.measuring.allocator import step_peak

    model, kwargs = build("swin")
    eager = copy.deepcopy(model)
    assert model.config.problem_type is None
    plan = remat.optimize(model, activation_budget=10**9, example_kwargs=kwargs,
                          solver="checkpoint_blocks")
    assert model.config.problem_type is None  # planning leaves the model as it was
    held = []
    for seed in (1, 2):
        for p in model.parameters():
            p.grad = None
        torch.manual_seed(seed)
        peak, _ = step_peak(lambda: plan.module(**kwargs),
                            lambda out, grad: out.loss.backward(grad))
        held.append(peak - sum(p.grad.numel() * p.grad.element_size()
                               for p in model.parameters() if p.grad is not None))
    assert len(plan.module.partitions) == 1  # compiled at the first call only
    eager(**kwargs)
    assert model.config.problem_type == eager.config.problem_type == \
        "single_label_classification"
    assert held[1] == plan.activation_peak, held
