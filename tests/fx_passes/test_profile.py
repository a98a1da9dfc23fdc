"""Profile and lowering against what PyTorch really does: FLOPs and the peak of live bytes."""
import functools

import pytest
import torch
import torch.nn as nn
from torch._functorch.partitioners import default_partition
from torch.utils.flop_counter import FlopCounterMode

from remat.fx_passes import (DEVICES, MemoryTracker, capture, compile_step, default_loss, device,
                             lower, measure_eager, profile, register_cpu_attention,
                             tracking_compilers)
from remat.fx_passes.measuring.memory_tracker import measure_partitioned
from remat.solvers import make_schedule, simulate
from tests import models

FAST = ["gpt", "mlp", "unet"]
SLOW = ["gpt2_hf", "transformer_encoder", "resnet"]
ALL = [*FAST, *(pytest.param(m, marks=pytest.mark.slow) for m in SLOW)]


@functools.lru_cache(maxsize=None)
def lowered(name):
    model, inputs = models.MODELS[name]()
    captured = capture(model, inputs)
    return model, inputs, captured, lower(captured)


def eager_flops(model, inputs):
    register_cpu_attention()
    with FlopCounterMode(display=False) as counter:
        default_loss(model(*inputs)).backward()
    model.zero_grad(set_to_none=True)
    return counter.get_total_flops()


@pytest.mark.parametrize("name", ALL)
def test_flops_match_flop_counter_mode(name):
    model, inputs, _, problem = lowered(name)
    expected = eager_flops(model, inputs)
    assert expected > 0
    assert problem.total_flops == expected


@pytest.mark.parametrize("name", ALL)
def test_save_all_simulation_predicts_default_partition_peak(name):
    model, inputs, _, problem = lowered(name)
    predicted = simulate(problem, make_schedule(problem, [])).peak
    tracker = measure_partitioned(model, inputs, default_partition)
    assert tracker.graph_calls == {"forward": 1, "backward": 1}  # the compiled graphs ran
    assert abs(predicted - tracker.peak) <= max(0.05 * tracker.peak, 2**20), (predicted,
                                                                            tracker.peak)


def test_tracker_inside_graphs_sees_the_compiled_step_not_eager():
    model, inputs = models.mlp(batch=16, width=64, depth=3)
    tracker = MemoryTracker(record=True)
    step = compile_step(model, default_partition, **tracking_compilers(tracker))
    step(*inputs).backward()
    assert tracker.graph_calls == {"forward": 1, "backward": 1}
    assert tracker.peak > 0 and tracker.timeline
    # The trap: a mode around the compiled call makes dynamo run eager code; ours saw ATen ops
    # of the graphs only (no autograd-engine ops such as AccumulateGrad's copies).
    ops = {op for op, _ in tracker.timeline}
    assert "aten.mm.default" in ops


def test_tracker_counts_views_once_and_excludes_the_baseline():
    base = torch.randn(256, 256)
    with MemoryTracker() as tracker:
        a = base * 2
        b = a.view(-1)
        c = a.t()
        peak_after_views = tracker.live
        del a, b, c
    assert peak_after_views == 256 * 256 * 4
    assert tracker.live == 0 and tracker.peak == 256 * 256 * 4


def test_measure_eager_step():
    model, inputs = models.mlp(batch=32, width=64, depth=2)
    tracker = measure_eager(lambda: default_loss(model(*inputs)).backward())
    assert tracker.peak > 32 * 64 * 4


def test_module_paths(name="gpt"):
    _, _, _, problem = lowered(name)
    modules = {op.module for op in problem.ops}
    assert "h.0.attn" in modules and "h.1.mlp.c_fc" in modules
    backward = {op.module for op in problem.ops[problem.num_forward:]}
    assert "h.1.attn.c_attn" in backward  # backward ops keep their forward's module


def test_devices_table_and_lookup():
    assert set(DEVICES) >= {"h100", "h200", "a100-80gb", "a100-40gb", "l4", "rtx4090"}
    assert device("H100 SXM") is DEVICES["h100"]
    assert device("A100 80GB") is DEVICES["a100-80gb"]
    assert device("rtx-4090") is DEVICES["rtx4090"]
    assert DEVICES["h200"].bandwidth > DEVICES["h100"].bandwidth
    with pytest.raises(KeyError, match="known"):
        device("tpu")


def test_roofline_cost_is_slower_on_slower_devices():
    model, inputs = models.mlp(batch=64, width=128, depth=2)
    fast = lower(capture(model, inputs), target="h100")
    slow = lower(capture(model, inputs), target="l4")
    assert 0 < fast.total_cost < slow.total_cost
    views = [op for op in fast.ops if op.kind.value == "view"]
    assert views and all(op.cost == 0 for op in views)
    matmuls = [op for op in fast.ops if op.target == "aten.mm.default"]
    assert all(op.flops > 0 and op.cost > 0 for op in matmuls)


def test_measure_on_cpu_when_asked():
    model, inputs = models.mlp(batch=16, width=32, depth=2)
    captured = capture(model, inputs)
    profile(captured, measure=True, device="cpu")
    times = {n.name: n.meta["remat"] for n in captured.graph.nodes if n.op == "call_function"}
    assert any(m["time_source"] == "measured" and m["time"] > 0 for m in times.values())


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_measure_defaults_to_a_gpu():
    model, inputs = models.mlp(batch=4, width=8, depth=1)
    with pytest.raises(RuntimeError, match="GPU"):
        profile(capture(model, inputs), measure=True)


def test_dtype_exact_bytes():
    model = nn.Linear(64, 64).to(torch.bfloat16)
    x = torch.randn(8, 64, dtype=torch.bfloat16)
    problem = lower(capture(model, (x,), loss_fn=lambda out: out.float().pow(2).mean()))
    addmm = next(op for op in problem.ops if op.target == "aten.addmm.default")
    assert addmm.size == 8 * 64 * 2


@pytest.mark.parametrize("name", ["unet", "resnet"])
def test_backward_views_come_just_before_their_first_reader(name):
    """The joint graph opens the backward with a detach of every saved activation; left there,
    each would make its base needed from the first backward op on, and no recomputation could
    lower the peak. Lowering moves every backward view next to its first reader."""
    from remat.solvers import Kind

    _, _, _, problem = lowered(name)
    ops = problem.ops
    moved = 0
    for i in problem.backward:
        if ops[i].kind is not Kind.VIEW or not problem.users[i]:
            continue
        first = problem.users[i][0]
        assert all(ops[j].kind is Kind.VIEW for j in range(i + 1, first)), ops[i].name
        moved += ops[i].target.endswith("detach.default")
    assert moved > 0


def test_recomputation_lowers_the_unet_peak_below_saving_everything():
    from remat.solvers import solve

    _, _, _, problem = lowered("unet")
    save_all = make_schedule(problem, []).peak
    schedule = solve(problem, int(save_all * 0.85), "optimal")
    assert schedule.peak <= save_all * 0.85 and schedule.recomputed


def test_kernel_scratch_measured_on_real_tensors_modelled_on_meta():
    """A real capture runs every op once under the allocator; a meta capture cannot run, and
    takes the workspace model (remat.fx_passes.measuring.workspace), which errs high."""
    def conv(device):
        torch.manual_seed(0)
        with torch.device(device):
            model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(inplace=True),
                                  nn.Conv2d(16, 4, 3, padding=1))
            x = torch.randn(2, 3, 16, 16)
        return model, (x,)

    problems = {}
    for device in ("cpu", "meta"):
        model, inputs = conv(device)
        captured = capture(model, inputs, loss_fn=lambda out: out.pow(2).mean())
        problems[device] = lower(captured)
        sources = {n.meta["remat"]["scratch_source"] for n in captured.graph.nodes
                   if n.op == "call_function" and n.meta["remat"].get("alias_of") is None
                   and "getitem" not in n.name}
        assert sources == {"measured" if device == "cpu" else "model"}, sources
        assert captured.graph_module.meta["remat_profile"].scratch_measured == (device == "cpu")
    real, meta = problems["cpu"], problems["meta"]
    backward = [i for i, op in enumerate(real.ops) if "convolution_backward" in op.target]
    assert backward and all(real.ops[i].temp > 0 for i in backward)
    assert all(m.temp >= r.temp for m, r in zip(meta.ops, real.ops))


class GroupedExperts(nn.Module):
    """MoE experts as torchtitan runs them: tokens sorted by expert, one `torch._grouped_mm`
    per weight over the per-expert offsets."""

    def __init__(self, experts=3, dim=16, hidden=8):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(experts, dim, hidden) / dim ** 0.5)
        self.w2 = nn.Parameter(torch.randn(experts, hidden, dim) / hidden ** 0.5)

    def forward(self, x, offsets):  # in bfloat16, as torchtitan's (PyTorch's meta wants it)
        h = torch.relu(torch._grouped_mm(x.bfloat16(), self.w1.bfloat16(), offs=offsets))
        return torch._grouped_mm(h, self.w2.bfloat16(), offs=offsets).float().square().mean()


def test_grouped_mm_flops_are_its_experts_matmuls():
    """PyTorch 2.13 has no FLOP formula for `_grouped_mm` (MoE experts counted zero FLOPs, so
    a plan minimizing FLOPs recomputed them for free). The reference: the same experts as one
    plain matmul per expert, forward and backward, counted by FlopCounterMode."""
    register_cpu_attention()
    model = GroupedExperts()
    counts = torch.tensor([5, 0, 7])
    x = torch.randn(int(counts.sum()), 16)
    offsets = torch.cumsum(counts, 0, dtype=torch.int32)
    with FlopCounterMode(display=False) as grouped:
        model(x, offsets).backward()
    rows = torch.split(x, counts.tolist())
    with FlopCounterMode(display=False) as looped:
        h = [torch.relu(r.bfloat16() @ w.bfloat16()) for r, w in zip(rows, model.w1)]
        torch.cat([a @ w.bfloat16() for a, w in zip(h, model.w2)]).float().square().mean() \
            .backward()
    assert grouped.get_total_flops() == looped.get_total_flops() > 0
    problem = lower(capture(model, (x, offsets)))
    assert problem.total_flops == grouped.get_total_flops()


def test_a_random_ops_seed_and_offset_are_made_on_the_cpu_to_run_an_op_alone():
    """Attention with dropout on CUDA returns its generator seed and offset, which eager
    PyTorch keeps on the CPU and the backward reads on the host (the traced values say CUDA);
    made up on the GPU, efficient attention's backward crashed the process. Traced here with
    fake CUDA tensors; "meta" stands for the GPU the other inputs are made on."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    from remat.fx_passes.measuring import scratch
    from remat.fx_passes.tracing.rng import generator_offsets

    def attention(q):
        out, lse, seed, offset = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, q, q, None, True, 0.1, True)
        return torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            out, q, q, q, None, out, lse, seed, offset, 0.1, [True, True, True, False], True)

    with FakeTensorMode():
        gm = make_fx(attention)(torch.empty(2, 2, 32, 16, device="cuda"))
    backward = next(n for n in gm.graph.nodes if "backward" in str(n.target))
    seeds = [a for a in backward.args if isinstance(a, torch.fx.Node) and generator_offsets(a)]
    assert len(seeds) == 2 and all(a.meta["val"].device.type == "cuda" for a in seeds)
    args, _ = scratch._arguments(backward, torch.device("meta"), torch.Generator())
    made = {a.name: v for a, v in zip(backward.args, args) if isinstance(a, torch.fx.Node)}
    assert {made[a.name].device.type for a in seeds} == {"cpu"}
    assert made[backward.args[1].name].device.type == "meta"  # the query, made on the device
    assert not generator_offsets(backward.args[0])  # the attention's output: a float
