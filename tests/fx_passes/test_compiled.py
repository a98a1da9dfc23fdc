"""The compiled path compiles: Inductor runs the plan, and an outer torch.compile keeps it.

Inductor compiles C++ for every kernel, so the models are tiny and the Inductor tests few: a
plan that recomputes nothing (an MLP), one that recomputes what the solver chose (a Llama-style
block stack), and one that replays dropout (nanoGPT). Each is checked against eager PyTorch's
gradients from the same weights and seed.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from remat.errors import BudgetError
from remat.fx_passes.tracing.capture import capture, default_loss
from remat.fx_passes.lowering.lower import lower
from remat.fx_passes.compiled.planned import planned_module
from remat.fx_passes.tracing.rng import RandomOp
from remat.solvers import SolverOptions, simulate, solve
from remat.solvers.core.schedule import drop_unneeded
from remat.solvers.timeline.evaluate import make_schedule
from tests import models


def llama_stack():
    """The Llama-style decoder of examples/llama.py at a tiny size, with real tokens."""
    path = Path(__file__).resolve().parents[2] / "examples" / "llama.py"
    spec = importlib.util.spec_from_file_location("_compiled_llama", path)
    example = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = example  # dataclasses look their module up there
    spec.loader.exec_module(example)
    config = example.LlamaConfig(vocab_size=64, hidden=32, layers=2, heads=2, mlp=64, seq=16)
    model, _ = example.llama(config, batch=2)
    g = torch.Generator().manual_seed(1)
    tokens, targets = (torch.randint(0, config.vocab_size, (2, config.seq), generator=g)
                       for _ in range(2))
    return model, (tokens, targets)


def tiny_gpt():
    return models.gpt(models.GPTConfig(block_size=8, vocab_size=32, n_layer=1, n_head=2,
                                       n_embd=16, dropout=0.2), batch=2)


def save_all(problem):
    return make_schedule(problem, (), budget=None)


def solver_plan(problem):
    """The exact solver's plan at 80 % of the save-all peak (or the least it can fit)."""
    budget = int(simulate(problem, save_all(problem)).peak * 0.8)
    options = SolverOptions(time_limit=5, workers=2)
    try:
        return solve(problem, budget, "optimal", options)
    except BudgetError as e:
        return solve(problem, e.smallest, "optimal", options)


def dropouts_recomputed(problem):
    """Every dropout recomputed (replayed from its snapshot), with what its outputs need."""
    drops = [i for i, op in enumerate(problem.ops)
             if op.target == "aten.native_dropout.default" and i < problem.num_forward]
    assert drops
    outputs = {g for d in drops for g in problem.users[d] if g < problem.num_forward}
    return make_schedule(problem, drop_unneeded(problem, set(drops) | outputs))


def step_both(model, inputs, schedule_of):
    """One Inductor-compiled planned step and one eager step, same weights and seed."""
    problem = lower(capture(model, inputs))
    schedule = schedule_of(problem)
    eager, plan = copy.deepcopy(model), copy.deepcopy(model)
    module = planned_module(plan, problem, schedule, compile=True)
    torch.manual_seed(1234)
    plan_loss = module(*inputs)
    plan_loss.backward()
    after_plan = torch.rand(4)  # where the step left the generator
    torch.manual_seed(1234)
    eager_loss = default_loss(eager(*inputs))
    eager_loss.backward()
    after_eager = torch.rand(4)
    assert abs(plan_loss.item() - eager_loss.item()) <= 1e-5 * abs(eager_loss.item())
    for (name, a), b in zip(eager.named_parameters(), plan.parameters()):
        scale = max(a.grad.abs().max().item(), 1e-30)
        assert (a.grad - b.grad).abs().max().item() <= 1e-5 * scale, name
    assert torch.equal(after_plan, after_eager)  # the next step draws what eager's draws
    return problem, schedule, module


@pytest.mark.slow
@pytest.mark.parametrize("name,factory,schedule_of", [
    ("mlp, nothing recomputed", lambda: models.mlp(batch=8, width=32, depth=3), save_all),
    ("llama, the solver's plan", llama_stack, solver_plan),
    ("gpt, dropout replayed", tiny_gpt, dropouts_recomputed),
])
def test_inductor_runs_the_plan_with_eager_gradients(name, factory, schedule_of, monkeypatch):
    import torch._inductor.compile_fx as compile_fx
    from torch._prims.rng_prims import run_with_rng_state

    compiled = []  # (graph, is_backward) for every graph Inductor compiles
    inner = compile_fx.compile_fx_inner

    def counting(gm, example_inputs, **kwargs):
        compiled.append((gm, kwargs.get("is_backward", False)))
        return inner(gm, example_inputs, **kwargs)

    monkeypatch.setattr(compile_fx, "compile_fx_inner", counting)
    model, inputs = factory()
    problem, schedule, module = step_both(model, inputs, schedule_of)
    assert [is_backward for _, is_backward in compiled] == [False, True]
    part = module.partition
    assert set(part.recomputed) == {problem.ops[i].name for i in schedule.recomputed}
    assert set(part.saved) == {problem.ops[i].name for i in schedule.saved}
    if schedule_of is save_all:
        assert not part.recomputed
    else:
        assert part.recomputed
    if schedule_of is dropouts_recomputed:
        # The backward Inductor compiled replays each dropout from its forward's snapshot;
        # with fresh randomness the gradients above would differ from eager's.
        replays = [n for n in part.backward.graph.nodes
                   if isinstance(n.target, RandomOp) and n.target.replay]
        assert replays
        compiled_replays = [n for n in compiled[1][0].graph.nodes
                            if n.target is run_with_rng_state]
        assert len(compiled_replays) == len(replays)


# --- torch.compile(plan.module) --------------------------------------------------------------

class CountingBackend:
    """An outer torch.compile backend that records the graphs it is given."""

    def __init__(self, backend: str):
        self.backend = backend
        self.graphs: list[torch.fx.GraphModule] = []

    def __call__(self, gm, example_inputs):
        from torch._dynamo.backends.registry import lookup_backend

        self.graphs.append(gm)
        return lookup_backend(self.backend)(gm, example_inputs)


@functools.cache
def tiny_budget() -> int:
    """An activation budget at which remat.optimize recomputes part of `models.mlp`'s step:
    60 % of its save-all peak, or the least it fits."""
    import remat

    model, inputs = models.mlp(batch=32, width=64, depth=4)
    # Activations are the step's peak less the state (the gradients too): 60 % of save-all's.
    saving_all = remat.optimize(model, activation_budget=10**15, example_inputs=inputs,
                                solver="save_all")
    budget = int(0.6 * saving_all.activation_peak)
    try:
        remat.optimize(model, activation_budget=budget, example_inputs=inputs,
                       solver_options=SolverOptions(time_limit=5, workers=2))
    except BudgetError as e:
        return e.smallest
    return budget


def tiny_plan():
    import remat

    model, inputs = models.mlp(batch=32, width=64, depth=4)
    plan = remat.optimize(model, activation_budget=tiny_budget(), example_inputs=inputs,
                          solver_options=SolverOptions(time_limit=5, workers=2))
    assert plan.schedule.recomputed
    return model, inputs, plan


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_an_outer_torch_compile_keeps_the_plan(backend):
    """torch.compile(plan.module) runs remat's own partitioned graphs: the outer backend gets
    no graph of the model, remat's partitioner runs, and its forward and backward graphs are
    the ones that execute (the recomputing backward, with eager's gradients)."""
    model, inputs, plan = tiny_plan()
    eager = copy.deepcopy(model)
    default_loss(eager(*inputs)).backward()
    module = plan.module
    outer = CountingBackend(backend)
    compiled = torch.compile(module, backend=outer)
    with module.instrument(contextlib.nullcontext()) as calls:
        compiled(*inputs).backward()
    assert calls.forward == 1 and calls.backward == 1
    assert len(module.partitions) == 1
    assert set(module.partition.recomputed) == {plan.problem.ops[i].name
                                                for i in plan.schedule.recomputed}
    assert not [n for g in outer.graphs for n in g.graph.nodes if n.op == "call_function"]
    for a, b in zip(eager.parameters(), model.parameters()):
        assert torch.allclose(a.grad, b.grad, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("how", ["torch.compile", "module.compile"])
def test_an_outer_fullgraph_compile_says_what_to_do(how):
    """fullgraph=True cannot keep the plan opaque: a RematError names the cause and the
    remedy (torch's own Unsupported is its cause), and nothing ran."""
    from torch._dynamo.exc import Unsupported

    from remat.errors import RematError

    torch._dynamo.reset()  # a module compiled earlier without fullgraph would skip tracing
    _, inputs, plan = tiny_plan()
    module = plan.module
    if how == "torch.compile":
        compiled = torch.compile(module, backend="aot_eager", fullgraph=True)
    else:
        module.compile(backend="aot_eager", fullgraph=True)
        compiled = module
    with pytest.raises(RematError, match=r"fullgraph=True.*opaque.*plan\.module directly.*"
                                         r"remat\.optimize\(\.\.\., compile=True\)") as e:
        compiled(*inputs)
    assert isinstance(e.value.__cause__, Unsupported)
    assert not module.partitions
