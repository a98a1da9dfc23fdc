"""`examples/hf_zoo.py --inductor`'s rows, without compiling: Inductor is replaced by the
op-by-op runners (remat's boxed_nop compilers; torch.compile of the applied eager plan by the
applied model itself), so each row must read what the op-by-op or eager plan predicts, with
eager PyTorch's gradients. The
Inductor readings themselves are docs/inductor.md's "The zoo under Inductor" (a minute of
compiles per row, not for the test suite)."""
import pytest
from torch._dynamo.backends.debugging import boxed_nop

import examples.zoo_inductor as zoo_inductor
import remat.fx_passes.compiled.planned as planned
from remat.planner.plans import step_reading
from examples.hf_zoo import run_arch
from remat.solvers import SolverOptions

pytest.importorskip("transformers")


def test_the_inductor_rows_run_and_are_judged(monkeypatch):
    monkeypatch.setattr(planned, "inductor_compilers", lambda *_: (boxed_nop, boxed_nop))
    monkeypatch.setattr(step_reading, "compile_applied", lambda model, blocks=None: model)
    rows = run_arch("llama", SolverOptions(time_limit=2), modes=("eager",), least=False,
                    inductor=True)
    assert [r.mode for r in rows] == ["compiled", "eager", "inductor", "eager+compile"]
    compiled, eager, remat_compiled, applied = rows
    assert not any(r.error for r in rows), rows
    # compile=True at the compiled row's budget; its reading (op by op here, where nothing is
    # fused: at least the simulation, which counts fused values at no bytes) is the prediction
    assert remat_compiled.budget == compiled.budget
    assert remat_compiled.predicted <= remat_compiled.budget
    assert remat_compiled.allocator == remat_compiled.predicted
    simulated = int(remat_compiled.note.removeprefix("simulated ").split(";")[0]
                    .replace(",", ""))
    assert simulated <= remat_compiled.predicted
    # an eager plan made with compile=True at the eager row's budget: its reading (of the
    # applied model, eagerly here) is the prediction, at most the eager timeline's
    assert applied.budget == eager.budget and applied.predicted <= applied.budget
    assert applied.allocator == applied.predicted
    simulated = int(applied.note.removeprefix("simulated ").split(";")[0].replace(",", ""))
    assert applied.predicted <= simulated
    assert applied.grad_diff == 0.0
    # the compiled plan's loss backward makes the softmax from the logits and their
    # log-sum-exp (remat.fx_passes.tracing.softmax_loss): a rounding away from eager's
    assert remat_compiled.grad_diff < 1e-6


def test_a_failed_mode_gives_its_inductor_row_a_cause():
    row, failed = zoo_inductor.inductor_rows("llama", "decoder", None, {}, [], None, None,
                                             None, SolverOptions())
    assert row.error.startswith("no compiled budget") and row.allocator is None
    assert failed.error.startswith("no eager plan") and failed.allocator is None


def test_gradients_beyond_the_sums_tolerance_are_judged_against_plain_torch_compile(
        monkeypatch):
    """A row whose gradients are 5e-3 off eager's passes where plain torch.compile of the same
    model is itself that far (Inductor's numerics on the model), and fails where it is not."""
    import copy
    from types import SimpleNamespace

    import torch

    from examples.hf_zoo import gradients, training_step

    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(4, 1)
            self.scale = 1.0

        def forward(self, x):
            return SimpleNamespace(loss=self.scale * self.linear(x).square().mean())

    torch.manual_seed(0)
    base, kwargs = Scaled(), {"x": torch.randn(8, 4)}
    reference = copy.deepcopy(base)
    training_step(reference, kwargs, seed=7)()
    expected = gradients(reference)
    for plain, fails in ((4e-3, False), (1e-4, True)):
        monkeypatch.setattr(zoo_inductor, "plain_compile_diff", lambda *_: plain)
        model = copy.deepcopy(base)
        model.scale = 1.005  # every gradient 5e-3 off, relative to the largest
        row = zoo_inductor.Row("toy", "decoder", "inductor", budget=0)
        row = zoo_inductor._run(row, model, model, kwargs, expected, base)
        assert row.grad_diff == pytest.approx(5e-3, rel=1e-3)
        assert bool(row.error) == fails, row
        assert ("plain torch.compile" in (row.error if fails else row.note)), row
