"""ZeRO-3 / FSDP2 memory per rank: the planner's prediction for the unsharded model against
what `torch.distributed.fsdp.fully_shard` holds on 2 gloo ranks, measured by the allocator
(torch.profiler memory events, which work under gloo).

The collectives are modelled as FSDP2 runs them on gloo (remat.fx_passes.lowering.sharding: flat
all-gather buffers freed late in the forward, gloo's scratch copy, copy-outs). The measured
step runs in eager autograd without remat and the prediction is the compiled mode's, 0.9 %
(22,020 bytes) under at 2 layers; that rest was not traced (before the collectives were
modelled in full it was 3.6 %, of which 88,064 bytes were eager's SwiGLU MulBackward0
holding two more (b, s, mlp) tensors). The eager mode's own prediction, which models eager
autograd, is checked in tests/planner/test_distributed.py."""
import json
import socket

import pytest

import remat
from remat.planner.job.training import Training
from tests.fsdp_worker import llama_model, run
from tests.ranks import spawn_ranks

WORLD = 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp")
    spawn_ranks(run, (WORLD, free_port(), str(out)), WORLD, seconds=600)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


def test_fsdp2_per_rank_peak_is_predicted_within_5_percent(measured):
    model, inputs = llama_model()
    training = Training(data_parallel=WORLD, zero_stage=3, optimizer="sgd", reserve=0,
                        fragmentation=0.0)
    plan = remat.optimize(model, activation_budget=10**12, example_inputs=inputs,
                          training=training, solver="save_all")
    state = plan.memory.state
    for rank in measured:
        # What each rank holds before the step: its parameter shards; after: the gradient
        # shards, exactly the state's terms.
        assert rank["shards"] == state.weights
        assert rank["grads"] == state.gradients
        # What is still allocated when the step returns is at least the gradient shards; on
        # rank 0 it has read 130-330 KB more in some runs of the whole suite and exactly the
        # shards alone (buffers gloo frees after the measurement; the peak was the same).
        assert rank["end"] >= rank["grads"]
        whole = rank["shards"] + rank["peak"]
        print(f"per-rank peak: predicted {plan.peak:,} measured {whole:,} "
              f"({100 * (plan.peak - whole) / whole:+.2f} %)")
        assert abs(whole - plan.peak) <= 0.05 * whole, (whole, plan.peak)


@pytest.fixture(scope="module")
def captured():
    from remat.fx_passes.tracing.capture import capture
    from remat.fx_passes.lowering.lower import lower

    model, inputs = llama_model(layers=2)
    c = capture(model, inputs)
    return model, inputs, c, lower(c)


def unit_bytes(c, unit):
    from remat.solvers.baselines.standard import block_of

    nodes = {n.name: n for n in c.placeholders}
    return sum(nodes[p].meta["val"].nbytes for p, name in c.params.items()
               if (block_of(name) or "root") == unit)


def test_zero2_keeps_a_full_gradient_only_until_its_blocks_reduce_scatter(captured):
    from remat.fx_passes.lowering.sharding import shard
    from remat.planner.job.accounting import graph_gradients
    from remat.solvers import make_schedule
    from remat.solvers.timeline.simulate import holds, step_order

    model, _, c, graph = captured
    sharded = shard(graph, c, data_parallel=4, zero_stage=2)
    problem = sharded.problem
    assert not any(op.target == "remat.all_gather" for op in problem.ops)  # ZeRO-2
    full = {op.name: op.size for op in problem.ops if op.target == "remat.reduce_scatter"}
    assert set(full) == {"reduce_scatter.layers.0", "reduce_scatter.layers.1",
                         "reduce_scatter.root"}
    assert sum(full.values()) == graph_gradients(graph) == 4 * sum(
        p.numel() for p in model.parameters())
    # The state's gradients are the shards: a quarter of each unit's, in the graph's dtype.
    assert graph_gradients(problem) == sum(-(-unit_bytes(c, u) // 16) * 4 for u in
                                           ("layers.0", "layers.1", "root"))
    schedule = make_schedule(problem, [])
    order = step_order(problem, schedule)
    step_of = {problem.ops[i].name: t for t, (i, _) in enumerate(order)}
    ends = {problem.ops[i].name: last for i, _, _, last in holds(problem, schedule, order)}
    grad_names = set(graph.source["param_gradients"])
    for unit in ("layers.0", "layers.1", "root"):
        rs = problem.ops[problem.index(f"reduce_scatter.{unit}")]
        for j in rs.inputs:  # the unit's full gradients die with its shard's making
            base = problem.ops[problem.root[j]].name
            assert problem.ops[j].name in grad_names
            assert ends[base] == step_of[f"grad_shard.{unit}"]
        # The buffer lives until the next unit's post-backward frees it, the root's to the end.
        assert ends[f"reduce_scatter.{unit}"] == (
            len(order) - 1 if unit == "root" else step_of[f"rs_wait.{unit}"])
    assert step_of["grad_shard.layers.1"] < step_of["grad_shard.layers.0"]
    for op in problem.ops:
        if op.target.startswith("remat."):
            assert op.not_recomputable.value == "collective"
            assert problem.index(op.name) not in problem.candidates


def test_zero3_gathers_each_block_for_its_forward_and_backward(captured):
    from remat.fx_passes.lowering.sharding import shard

    _, _, c, graph = captured
    problem = shard(graph, c, data_parallel=2, zero_stage=3, prefetch=1).problem
    names = [op.name for op in problem.ops]
    gathers = {op.name: op.size for op in problem.ops if op.target.startswith("remat.all_gather")}
    for unit in ("layers.0", "layers.1"):
        assert gathers[f"all_gather.{unit}"] == gathers[f"all_gather_bwd.{unit}"] \
            == unit_bytes(c, unit)
    assert gathers["all_gather.root"] == unit_bytes(c, "root")
    op = lambda name: problem.ops[problem.index(name)]  # noqa: E731
    assert op("copy_out.root").is_output  # the root's parameters are kept to the step's end
    # gloo's all-gather holds a flat copy of its output while it runs (captured on the CPU).
    assert all(o.temp == o.size for o in problem.ops if o.target == "remat.all_gather")
    # The forward defers freeing a flat buffer to the next unit's copy-out; the backward
    # frees it at the unit's own.
    assert [problem.ops[i].name for i in op("copy_out.layers.1").inputs] == [
        "all_gather.layers.1", "all_gather.layers.0"]
    assert [problem.ops[i].name for i in op("copy_out_bwd.layers.0").inputs] == [
        "all_gather_bwd.layers.0"]
    # The root's pre-backward, at the backward's start, prefetches the last block.
    first_backward = next(i for i, o in enumerate(problem.ops) if o.phase.value == "backward")
    assert names[first_backward] == "all_gather_bwd.layers.1"
    # Prefetch 1: block 1 is gathered as block 0 starts, before block 0's first op.
    first_of_block0 = next(i for i, op in enumerate(problem.ops) if op.module.startswith(
        "layers.0") and not op.target.startswith("remat"))
    assert names.index("all_gather.layers.1") < first_of_block0
    assert names.index("reshard.layers.0") < names.index("reshard.layers.1")
    no_prefetch = [op.name for op in shard(graph, c, data_parallel=2, zero_stage=3,
                                           prefetch=0).problem.ops]
    assert no_prefetch.index("all_gather.layers.1") > no_prefetch.index("reshard.layers.0")


def test_a_sharded_plan_that_recomputes_runs_with_eagers_gradients():
    import torch

    model, inputs = llama_model(layers=2)
    training = Training(data_parallel=2, zero_stage=3, optimizer="sgd", reserve=0,
                        fragmentation=0.0)
    save_all = remat.optimize(model, activation_budget=10**12, example_inputs=inputs,
                              training=training, solver="save_all")
    plan = remat.optimize(model, activation_budget=save_all.activation_peak * 9 // 10,
                          example_inputs=inputs, training=training, solver="checkpoint_blocks")
    assert plan.recompute_flops > 0
    expected = model(*inputs)
    expected.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    loss = plan.module(*inputs)
    loss.backward()
    torch.testing.assert_close(loss, expected)
    for p, g in zip(model.parameters(), grads):
        torch.testing.assert_close(p.grad, g, rtol=1e-4, atol=1e-5)
