"""Capture and lowering: one graph or an error naming the break; names, phases, reasons."""
import pytest
import torch
import torch.nn as nn

from remat.errors import CaptureError
from remat.fx_passes import capture, lower, op_nodes
from remat.fx_passes.tracing.rng import state_bytes
from remat.solvers import Kind, Phase, Reason
from tests import models


@pytest.fixture(scope="module")
def tiny_gpt():
    model, inputs = models.gpt()
    captured = capture(model, inputs)
    return model, captured, lower(captured)


class _ItemBreak(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        if y.sum().item() > 0:  # data-dependent Python branch: a graph break
            return y.pow(2).mean()
        return y.mean()


class _PrintBreak(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        print("loss so far", y.shape)
        return y.mean()


@pytest.mark.parametrize("module", [_ItemBreak, _PrintBreak])
def test_graph_break_raises_capture_error_naming_the_line(module):
    with pytest.raises(CaptureError) as info:
        capture(module(), (torch.randn(2, 4),))
    message = str(info.value)
    assert "graph break" in message
    assert "test_capture.py" in message  # the user's line, not remat's


def test_loss_without_grad_is_an_error():
    model = nn.Linear(4, 4).requires_grad_(False)
    with pytest.raises(CaptureError, match="backward"):
        capture(model, (torch.randn(2, 4),), loss_fn=lambda out: out.sum())


def test_capture_does_not_run_or_mutate_the_model():
    model, inputs = models.resnet()
    stats = model.stem[1].running_mean.clone()
    capture(model, inputs)
    assert torch.equal(stats, model.stem[1].running_mean)
    assert int(model.stem[1].num_batches_tracked) == 0


def test_op_names_are_joint_graph_node_names(tiny_gpt):
    _, captured, problem = tiny_gpt
    nodes = op_nodes(captured, problem)
    assert [n.name for n in nodes] == [op.name for op in problem.ops]
    assert all(n.op == "call_function" for n in nodes)


def test_placeholders_classified(tiny_gpt):
    model, captured, _ = tiny_gpt
    # wte and lm_head share one tensor: one placeholder
    assert sorted(set(captured.params.values())) == sorted(
        n for n, _ in model.named_parameters())
    assert len(captured.user_inputs) == 2 and len(captured.tangents) == 1
    assert captured.param_count == sum(p.numel() for p in model.parameters())


def test_phases_and_outputs(tiny_gpt):
    _, captured, problem = tiny_gpt
    fwd = [op for op in problem.ops if op.phase is Phase.FORWARD]
    assert fwd == list(problem.ops[: problem.num_forward])
    loss = [op for op in fwd if op.is_output]
    # the fp32 scalar loss, and the seed of the backward (its gradient, held as long)
    assert len(loss) == 1 and loss[0].size == 4 + 4
    assert problem.source["seeds"] == {loss[0].name: 4}
    grads = [op for op in problem.ops[problem.num_forward:] if op.is_output]
    assert len(grads) == len(captured.gradient_outputs)


def test_kinds(tiny_gpt):
    _, _, problem = tiny_gpt
    for i, op in enumerate(problem.ops):
        if op.kind is Kind.TUPLE:
            getitems = [problem.ops[j] for j in problem.users[i]]
            assert all(g.kind is Kind.TENSOR and g.inputs == (i,) and g.cost == 0
                       for g in getitems)
            seeds = problem.source["seeds"]  # a loss's size counts its seed (lower)
            assert op.temp >= sum(g.size - seeds.get(g.name, 0) for g in getitems)
        if op.kind is Kind.VIEW:
            assert op.size == 0
    assert any(op.target == "aten.split.Tensor" and op.kind is Kind.VIEW for op in problem.ops)


def test_every_non_recomputable_op_has_a_reason(tiny_gpt):
    _, _, problem = tiny_gpt
    reasons = {op.target: op.not_recomputable for op in problem.ops if op.not_recomputable}
    assert all(isinstance(r, Reason) for r in reasons.values())
    # Dropout replays from a snapshot of the generator, which itself cannot be taken again.
    assert reasons.get("remat.fx_passes.tracing.rng.rng_state") is Reason.RANDOM
    dropouts = [op for op in problem.ops if op.target == "aten.native_dropout.default"]
    assert dropouts and all(op.not_recomputable is None for op in dropouts)
    for op in dropouts:
        snapshot = problem.ops[op.inputs[0]]
        assert snapshot.name == op.name + "_rng_state" and snapshot.size == state_bytes(
            torch.device("cpu"))


def test_batchnorm_reads_mutated_statistics():
    model, inputs = models.resnet()
    captured = capture(model, inputs)
    problem = lower(captured)
    assert captured.mutated_inputs and set(captured.mutated_inputs) <= set(captured.buffers)
    bn = [op for op in problem.ops if "batch_norm_legit_functional" in op.target]
    assert bn and all(op.not_recomputable is Reason.MUTATION for op in bn)


def test_meta_capture_equals_real_capture(tiny_gpt):
    _, _, real = tiny_gpt
    model, inputs = models.gpt(device="meta")
    meta_captured = capture(model, inputs)
    fake = lower(meta_captured)
    assert meta_captured.device == "meta"
    assert model.lm_head.weight.device.type == "meta"  # the model got its tensors back
    key = lambda p: [(o.name, o.phase, o.inputs, o.size, o.kind, o.flops,
                      o.not_recomputable, o.is_output) for o in p.ops]
    assert key(fake) == key(real)
    # Kernel scratch: measured on the real capture, modelled (erring high) on the meta one.
    assert all(f.temp >= r.temp for f, r in zip(fake.ops, real.ops))


def test_source_describes_the_step(tiny_gpt):
    _, _, problem = tiny_gpt
    assert problem.source["model"] == "GPT"
    assert problem.source["batch_shapes"] == [[4, 32], [4, 32]]
    assert problem.source["dtype"] == "float32" and problem.source["target"] == "H100 SXM"


class _Attention(nn.Module):
    def __init__(self, p: float):
        super().__init__()
        self.qkv = nn.Linear(16, 48)
        self.p = p

    def forward(self, x):
        q, k, v = self.qkv(x).view(2, 8, 3, 2, 8).permute(2, 0, 3, 1, 4)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=self.p).sum()


@pytest.mark.parametrize("p", [0.0, 0.1])
def test_attention_draws_only_with_dropout(p):
    """SDPA is tagged random whatever its dropout: at p=0 it must count its FLOPs, need no
    generator snapshot and be recomputable; with dropout it replays from a snapshot."""
    torch.manual_seed(0)
    problem = lower(capture(_Attention(p), (torch.randn(2, 8, 16),)))
    attention = [op for op in problem.ops if "scaled_dot_product" in op.target
                 and op.phase is Phase.FORWARD]
    snapshots = [op for op in problem.ops if op.target == "remat.fx_passes.tracing.rng.rng_state"]
    if p == 0.0:
        assert attention and not snapshots
        assert all(op.flops > 0 and op.not_recomputable is None for op in attention)
    else:
        # With dropout, CPU attention takes the math path: its dropout replays.
        assert snapshots and all(op.not_recomputable is Reason.RANDOM for op in snapshots)


class _SliceCopies(nn.Module):  # DeepSeek-V3's expand_kv, twice: the same copy ops again
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.ModuleList(nn.Linear(8, 16) for _ in range(2)), \
            nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

    def forward(self, x):
        for a, b in zip(self.a, self.b):
            kn, kr = a(x), b(x)
            k = kn.new_empty(*kn.shape[:-1], 24)
            k[..., :16].copy_(kn)
            k[..., 16:].copy_(kr)
            x = x + k[..., ::3]
        return x.pow(2).mean()


def test_an_op_repeated_in_one_trace_owns_the_bytes_its_kernel_allocates():
    """Torch's fake-tensor cache remade a repeated copy into a slice without its storage
    offset (fewer bytes than the kernel allocates); two captures of one model then
    disagreed, and no plan of DeepSeek-V3 could run. The bytes of every copy are the real
    kernel's, and equal between captures."""
    x = torch.randn(5, 3, 8)
    first, second = (lower(capture(_SliceCopies(), (x,))) for _ in range(2))
    assert [op.size for op in first.ops] == [op.size for op in second.ops]
    copies = [op.size for op in first.ops if op.target == "aten.copy.default"]
    buffer = torch.empty(5, 3, 24)
    real = torch.ops.aten.copy.default(buffer[..., 16:], torch.zeros(5, 3, 8))
    assert len(copies) >= 4 and real.untyped_storage().nbytes() in copies
    assert all(size in (real.untyped_storage().nbytes(), buffer.untyped_storage().nbytes())
               for size in copies), copies


class _ExpertsHit(nn.Module):  # DBRX's experts: a loop over the experts the batch hits
    def __init__(self):
        super().__init__()
        self.gate, self.experts = nn.Linear(8, 4), nn.ModuleList(nn.Linear(8, 8) for _ in range(4))

    def forward(self, x):
        chosen = self.gate(x).argmax(-1)
        out = torch.zeros_like(x)
        for e in torch.bincount(chosen, minlength=4).nonzero():
            rows = torch.where(chosen == e[0])[0]
            out = out.index_add(0, rows, self.experts[0](x[rows]))
        return out.pow(2).mean()


def test_a_data_dependent_number_of_ops_is_named_with_its_remedy():
    with pytest.raises(CaptureError) as info:
        capture(_ExpertsHit(), (torch.randn(16, 8),))
    message = str(info.value)
    assert "depend on the data" in message and "fixed range" in message


class _Router(nn.Module):  # Mixtral's router: top-k weights normalized in place
    def __init__(self):
        super().__init__()
        self.gate, self.up = nn.Linear(8, 4), nn.Linear(8, 8)

    def weights(self, x):
        top, _ = torch.softmax(self.gate(x), dim=-1).topk(2, dim=-1)
        top /= top.sum(dim=-1, keepdim=True)
        return top.sum(-1, keepdim=True)

    def forward(self, x):
        weights = self.weights(x)
        return (self.up(x) * weights).pow(2).mean()


def test_backward_ops_no_gradient_reaches_run_where_they_are_read():
    """The joint graph computes some backward ops from forward values alone (the router's
    clone of its top-k weights) at the very start of the backward; eager autograd runs them in
    the node that reads them, and so does the lowered order."""
    captured = capture(_Router(), (torch.randn(16, 8),))
    problem = lower(captured)
    nodes = op_nodes(captured, problem)
    tangents = set(captured.tangents)
    first = nodes[problem.num_forward]
    assert any(a.op == "placeholder" and a.name in tangents for a in first.all_input_nodes)
    joint_backward = [n.name for n in captured.graph.nodes
                      if n.name in {problem.ops[b].name for b in problem.backward}]
    assert joint_backward[0] != first.name  # the joint graph did hoist one


class _RouterStage(_Router):  # the router as a pipeline stage before the last
    def forward(self, x):
        weights = self.weights(x)
        return torch.relu(self.up(x)) * weights


def test_a_stage_backward_starts_from_the_gradient_the_next_stage_sends():
    """A stage before the last gets its output's gradient from a buffer (`Seed`), and the
    loss's tangent reaches no op: the backward starts from the buffer, and what no gradient
    reaches still waits for its reader (were nothing reached, nothing would move: the saved
    activations' detaches would open the backward, and the eager planner recompute every
    block up front; a Llama stage 0 checkpointing its block was predicted 24 % over)."""
    from remat.fx_passes.tracing.stage_step import StageStep

    step = StageStep(_RouterStage(), output_grad=torch.randn(16, 8))
    captured = capture(step, (torch.randn(16, 8),), loss_fn=lambda out: out[0])
    problem = lower(captured)
    nodes = op_nodes(captured, problem)
    received = {p for p, name in captured.buffers.items() if name == "output_grad"}
    assert len(received) == 1
    first = nodes[problem.num_forward]
    assert any(a.name in received for a in first.all_input_nodes), first
