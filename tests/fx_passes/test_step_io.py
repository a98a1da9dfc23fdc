"""What the captured step takes and returns: keyword inputs, the model's own output, and each
error a user meets first, matched against the condition that produced it."""
import copy
import logging

import pytest
import torch
import torch.nn as nn

from remat.errors import CaptureError, RematError
from remat.fx_passes import capture
from remat.fx_passes.tracing import step_io
from remat.planner.optimize import optimize
from remat.solvers import SolverOptions

OPTIONS = SolverOptions(time_limit=10, workers=2)


class Classifier(nn.Module):
    """Returns what `returns` says: logits, (logits, loss), or a dict with both."""

    def __init__(self, returns="dict", dropout=0.1):
        super().__init__()
        self.returns = returns
        self.body = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Dropout(dropout),
                                  nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 10))

    def forward(self, x, labels=None, scale=1.0):
        logits = self.body(x) * scale
        if self.returns == "logits":
            return logits
        loss = nn.functional.cross_entropy(logits, labels)
        if self.returns == "tuple":
            return logits, loss
        if self.returns == "no loss":
            return {"logits": logits}
        return {"loss": loss, "logits": logits}


def batch():
    g = torch.Generator().manual_seed(0)
    return torch.randn(16, 8, generator=g), torch.randint(0, 10, (16,), generator=g)


def assert_same_grads(a: nn.Module, b: nn.Module):
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert p.grad is not None and q.grad is not None, name
        assert (p.grad - q.grad).abs().max().item() <= 1e-6 * max(p.grad.abs().max(), 1e-30)


def test_keyword_inputs_and_the_models_own_output_come_back():
    torch.manual_seed(0)
    model = Classifier("dict").train()
    eager = copy.deepcopy(model)
    x, y = batch()
    plan = optimize(model, activation_budget="1MB", example_inputs=(x,),
                    example_kwargs={"labels": y, "scale": 0.5}, solver_options=OPTIONS)
    torch.manual_seed(3)
    out = plan.module(x, labels=y, scale=0.5)
    assert set(out) == {"loss", "logits"}
    assert out["loss"].requires_grad and not out["logits"].requires_grad  # detached: see docs
    out["loss"].backward()
    torch.manual_seed(3)
    expected = eager(x, labels=y, scale=0.5)
    expected["loss"].backward()
    assert torch.equal(out["logits"], expected["logits"])  # dropout replayed, same numbers
    assert_same_grads(eager, model)


def test_returns_loss_gives_the_loss_tensor():
    model = Classifier("dict", dropout=0.0)
    x, y = batch()
    plan = optimize(model, activation_budget="1MB", example_inputs=(x, y), returns="loss",
                    solver="save_all")
    loss = plan.module(x, y)
    assert isinstance(loss, torch.Tensor) and loss.dim() == 0


@pytest.mark.parametrize("returns, what", [
    ("logits", "the tensor the model returned"),
    ("tuple", "its first element of the tuple the model returned"),
])
def test_a_loss_that_is_not_a_scalar_is_refused_with_the_remedy(returns, what):
    x, y = batch()
    with pytest.raises(CaptureError) as info:
        capture(Classifier(returns), (x, y))
    message = str(info.value)
    assert f"the loss ({what}) is a float32 tensor of shape (16, 10), not a floating scalar" \
        in message
    assert "pass loss_fn=" in message
    assert "graph break" not in message  # remat's own error, raised inside dynamo's trace


def test_loss_fn_picks_the_loss_of_a_tuple():
    x, y = batch()
    plan = optimize(Classifier("tuple", dropout=0.0), activation_budget="1MB",
                    example_inputs=(x, y), loss_fn=lambda out: out[1], solver="save_all")
    loss = plan.module(x, y)
    assert loss.dim() == 0 and loss.requires_grad


def test_an_output_without_a_loss_is_named_not_called_a_graph_break():
    x, y = batch()
    with pytest.raises(CaptureError) as info:
        capture(Classifier("no loss"), (x, y))
    message = str(info.value)
    assert message.startswith("the model returned dict without a loss tensor")
    assert "loss_fn=" in message and "graph break" not in message


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_inputs_of_another_dtype_than_the_model_are_refused(dtype):
    x, y = batch()
    with pytest.raises(CaptureError) as info:
        capture(Classifier(), (x.to(dtype),), example_kwargs={"labels": y})
    name = str(dtype).replace("torch.", "")
    assert (f"input example_inputs[0] is {name} but the model's parameters are float32"
            in str(info.value))
    assert f"model.to(torch.{name})" in str(info.value)


def test_a_wrong_shape_names_the_inputs_and_shapes_without_log_spew(capfd):
    model = Classifier()
    x, y = batch()
    with pytest.raises(CaptureError) as info:
        capture(model, (x[:, :5],), example_kwargs={"labels": y})
    message = str(info.value)
    assert message.startswith("the model fails on these inputs, in eager PyTorch too: "
                              "RuntimeError: a and b must have same reduction dim, but got [16, 5] X [8, 32]")
    assert "inputs: example_inputs[0]: float32 (16, 5); example_kwargs['labels']: int64 (16,)" \
        in message
    assert "test_step_io.py" in message  # the user's line
    assert "graph break" not in message
    err = capfd.readouterr().err
    assert "Traceback" not in err and "fake_tensor.py" not in err


def test_a_non_tensor_input_is_named_not_called_a_graph_break():
    with pytest.raises(CaptureError) as info:
        capture(Classifier("logits"), ([[0.0] * 8] * 4,), loss_fn=lambda out: out.sum())
    message = str(info.value)
    assert "TypeError" in message and "example_inputs[0]: list" in message
    assert "graph break" not in message


def test_the_plan_states_its_mode_and_refuses_the_other():
    x, y = batch()
    model = Classifier("dict").train()
    plan = optimize(model, activation_budget="1MB", example_inputs=(x, y), solver="save_all")
    assert plan.training_mode == "train" and plan.to_dict()["mode"] == "train"
    model.eval()
    out = plan.module(x, y)  # evaluation in the other mode runs the model itself ...
    assert torch.equal(out["loss"], model(x, y)["loss"])
    with pytest.raises(RematError, match=r"^planned in train mode, but the model is in eval "
                                         r"mode now; call model.train\(\)"):
        out["loss"].backward()  # ... but training on it without the plan is refused
    model.train()
    plan.module(x, y)["loss"].backward()  # back in the planned mode, it runs
    eval_plan = optimize(model.eval(), activation_budget="1MB", example_inputs=(x, y),
                         solver="save_all")
    assert eval_plan.training_mode == "eval"


def test_a_long_capture_logs_its_progress(monkeypatch, caplog):
    monkeypatch.setattr(step_io, "PROGRESS_EVERY", 0.02)
    x, y = batch()
    with caplog.at_level(logging.INFO, logger="remat.fx_passes.tracing.step_io"):
        capture(Classifier(), (x, y))
    lines = [r.getMessage() for r in caplog.records if "graph nodes traced" in r.getMessage()]
    assert lines and lines[0].startswith("capturing Classifier: ")
    assert torch.fx.Graph.create_node.__name__ == "create_node"  # the counter is removed


def test_a_returned_key_value_cache_is_warned_about(caplog):
    from types import SimpleNamespace

    class WithCache(Classifier):  # a forward that takes use_cache, as a decoder's does
        def forward(self, x, labels=None, use_cache=None):
            return super().forward(x, labels)

    x, y = batch()
    for model, warned in ((Classifier("dict", dropout=0.0), False),
                          (WithCache("dict", dropout=0.0), True)):
        model.config = SimpleNamespace(use_cache=True)  # as a Hugging Face model's config
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="remat.planner.optimize"):
            optimize(model, activation_budget="1MB", example_inputs=(x, y), solver="save_all")
        assert warned == any("returns its key/value cache (config.use_cache=True on "
                             "model.config)" in r.getMessage()
                             and "set use_cache=False" in r.getMessage()
                             for r in caplog.records)


def test_keyword_inputs_on_the_meta_device_capture_the_same_graph():
    x, y = batch()
    real = capture(Classifier(dropout=0.0), (), example_kwargs={"x": x, "labels": y})
    with torch.device("meta"):
        model = Classifier(dropout=0.0)
    meta = capture(model, (), example_kwargs={"x": x.to("meta"), "labels": y.to("meta")})
    assert [n.name for n in meta.graph.nodes] == [n.name for n in real.graph.nodes]
    assert meta.input_shapes == real.input_shapes == [(16, 8), (16,)]
