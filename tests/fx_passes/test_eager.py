"""execution="eager": per-block selective checkpointing, judged by eager PyTorch's gradients and
the allocator (torch.profiler memory events) of the real step."""
from __future__ import annotations

import copy
from dataclasses import replace
from functools import partial
import subprocess
import sys

import pytest
import torch

import remat
from remat.errors import BudgetError, RematError
from remat.fx_passes.measuring.allocator import peak_and_result as allocator_peak
from remat.fx_passes.eager.apply import apply_eager
from remat.fx_passes.eager.block_policy import with_cache
from remat.planner.plans.eager_plan import plan_eager_mode
from remat.planner.plans.prepare import prepare
from remat.solvers import SolverOptions, Strategy
from remat.solvers.core.schedule import Status
from remat.solvers.timeline.eager import eager_schedule
from remat.solvers.timeline.eager_blocks import block_runs
from examples.llama import LLAMA_TEST, tiny_llama

CONFIG = replace(LLAMA_TEST, seq=32)
FAST = SolverOptions(time_limit=5)


@pytest.fixture(scope="module")
def llama():
    model, inputs = tiny_llama(CONFIG, batch=4)
    return model, inputs, prepare(model, inputs)


def plan_at(llama, budget, **kw):
    model, inputs, prepared = llama
    return plan_eager_mode(model, prepared, budget=None, activation_budget=budget, target="h100",
                           solver=kw.pop("solver", Strategy.OPTIMAL),
                           solver_options=kw.pop("options", FAST),
                           blocks=kw.pop("blocks", None), example_inputs=inputs)


def step(model, inputs, seed=7):
    torch.manual_seed(seed)
    loss = model(*inputs)
    loss.backward()
    return float(loss.detach())


def plain_peak_and_grads(llama):
    model, inputs, _ = llama
    ref = copy.deepcopy(model)
    peak, loss = allocator_peak(lambda: step(ref, inputs))
    return peak, loss, {n: p.grad for n, p in ref.named_parameters()}


def test_solvers_eager_is_torch_free():
    code = ("import sys; sys.modules['torch'] = None; import remat.solvers.timeline.eager, "
            "remat.solvers; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "ok", out.stderr


@pytest.mark.parametrize("fraction", [0.7, 0.85])
def test_eager_plan_gradients_equal_eager_and_peak_matches_allocator(llama, fraction):
    model, inputs, _ = llama
    plain, plain_loss, grads = plain_peak_and_grads(llama)
    budget = int(plain * fraction)
    plan = plan_at(llama, budget)
    assert plan.activation_peak <= budget
    assert plan.schedule.info["execution"] == "eager"
    # The exact eager search answers with what it proved: a bound and a gap. Whether it also
    # closes the gap within the time limit depends on the machine's load, so it is not
    # asserted here; tests/solvers/test_eager_exact.py checks optimality against brute force.
    assert plan.status in (Status.OPTIMAL, Status.FEASIBLE)
    mine = plan.apply(copy.deepcopy(model))
    measured, loss = allocator_peak(lambda: step(mine, inputs))
    # Dropout is on: equal gradients mean checkpoint replayed the same masks.
    assert loss == plain_loss
    for name, p in mine.named_parameters():
        torch.testing.assert_close(p.grad, grads[name], rtol=1e-5, atol=1e-7, msg=name)
    # The allocator sees the whole step: the activations and the gradients the graph makes.
    predicted = plan.memory.simulated_peak
    assert predicted == plan.activation_peak + plan.memory.graph_gradients
    assert abs(measured - predicted) <= 0.01 * measured, (measured, predicted)
    assert measured < plain


def test_eager_model_predicts_whole_block_checkpointing(llama):
    """The policy that caches nothing (torch.utils.checkpoint on every block), predicted by the
    eager model and measured: a check of the trigger, early stop and lifetimes alone."""
    model, inputs, _ = llama
    plan = plan_at(llama, 10**9)
    problem, blocks = plan.eager_problem, plan.structure
    predicted = eager_schedule(problem, blocks, ()).peak
    mine = apply_eager(copy.deepcopy(model),
                       {p: with_cache(pol, frozenset()) for p, pol in plan.policies.items()})
    measured, _ = allocator_peak(lambda: step(mine, inputs))
    assert abs(measured - predicted) <= 0.01 * measured, (measured, predicted)
    # Early stop: the recomputation never runs the block's last ops (the residual adds).
    for run in block_runs(problem, blocks, ()):
        assert run.stop < blocks.ops[run.name][-1]


def step_flops(model, inputs) -> int:
    from remat.fx_passes.measuring.flops import FlopCounter

    with FlopCounter() as counter:
        step(model, inputs)
    return counter.total


def test_recompute_flops_are_what_the_applied_plan_runs_again(llama):
    """Attention on the CPU is one call with two tensors (output and logsumexp): a policy that
    caches both does not run it again (checkpoint hands them over), so the plan counts no
    recomputation for it, and caching attention is worth its bytes. Judged by the FLOPs that
    the applied step really runs (a dispatch-mode counter), less the plain step's. (The
    planner once charged the call whatever was cached, and never cached attention: 1 MFLOP
    more at every budget here, torchtitan's Llama3 likewise.)"""
    model, inputs, _ = llama
    plain = step_flops(copy.deepcopy(model), inputs)
    everything = plan_at(llama, 10**9)
    assert everything.recompute_flops == 0
    middle = plan_at(llama, int(0.8 * everything.activation_peak))
    assert any("scaled_dot_product" in pol.ops[k]
               for pol in middle.block_policies.values() for k in pol.cache)
    for plan in (everything, middle):
        measured = step_flops(plan.apply(copy.deepcopy(model)), inputs) - plain
        assert measured == plan.recompute_flops


def test_blocks_by_name_is_the_default(llama):
    named = plan_at(llama, 10**9, blocks=["layers"])
    default = plan_at(llama, 10**9)
    assert sorted(named.policies) == sorted(default.policies) == ["layers.0", "layers.1"]


def test_a_block_whose_ops_differ_at_run_time_is_named(llama):
    model, inputs, _ = llama
    plan = plan_at(llama, 10**9)
    mine = plan.apply(copy.deepcopy(model))
    mine.layers[1].drop = torch.nn.Identity()  # the run now skips the block's dropouts
    with pytest.raises(RematError, match="block 'layers.1'"):
        step(mine, inputs)


def test_policy_answers_the_recomputation_like_the_forward():
    """torch 2.11 asks the policy again for each op it recomputes (`ctx.is_recompute`); 2.13
    asks only in the forward. Either way the recomputation gets the forward's answer for the
    same position, and the forward's count is left alone (it checks the block's op count)."""
    import itertools

    from torch.utils.checkpoint import CheckpointPolicy, SelectiveCheckpointContext

    from remat.fx_passes.eager.selective import policy_contexts
    from remat.fx_passes.eager.block_policy import BlockPolicy

    ops = ("aten.mm.default", "aten.relu.default", "aten.mm.default")
    policy = with_cache(BlockPolicy("b", ops, ((0,), (1,), (2,)), (True, True, True)),
                        frozenset({0, 2}))
    forward = itertools.count()
    caching, _ = policy_contexts(policy, forward)
    decide = caching.policy_fn
    aten = torch.ops.aten
    calls = [aten.mm.default, aten.relu.default, aten.mm.default]
    first = [decide(SelectiveCheckpointContext(is_recompute=False), op) for op in calls]
    again = [decide(SelectiveCheckpointContext(is_recompute=True), op) for op in calls[:2]]
    save, recompute = CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE
    assert first == [save, recompute, save] and again == first[:2]
    assert next(forward) == len(ops)
    with pytest.raises(RematError, match="op 2 of the run is aten.relu"):
        decide(SelectiveCheckpointContext(is_recompute=True), aten.relu.default)


def test_apply_refuses_twice_and_other_models(llama):
    model, _, _ = llama
    plan = plan_at(llama, 10**9)
    mine = plan.apply(copy.deepcopy(model))
    with pytest.raises(RematError, match="already wrapped"):
        plan.apply(mine)
    other, _ = tiny_llama(replace(LLAMA_TEST, hidden=16, mlp=40, seq=32))
    with pytest.raises(RematError, match="parameters differ"):
        plan.apply(other)


def test_budget_below_the_least_eager_peak_raises(llama):
    # A clock that never moves: every stage runs to its end, as on an idle machine, so the
    # error is the proven one whatever the load (tests/solvers/test_no_time.py covers the
    # answers when the time runs out)
    untimed = SolverOptions(time_limit=5, clock=lambda: 0.0)
    with pytest.raises(BudgetError):
        plan_at(llama, 1000, options=untimed)


def test_execution_argument_is_checked(llama):
    model, inputs, _ = llama
    with pytest.raises(ValueError, match="execution"):
        remat.optimize(model, activation_budget=10**9, example_inputs=inputs, execution="lazy")
    with pytest.raises(ValueError, match="blocks="):
        remat.optimize(model, activation_budget=10**9, example_inputs=inputs, blocks=["layers"])


def test_hugging_face_gpt2_trains_like_eager_and_refuses_a_kv_cache():
    """transformers' GPT-2 (SDPA, dropout on): its joint graph shares the causal mask between
    blocks and reorders ops, which the probe and the alignment absorb; a model that would
    append to its key/value cache when recomputed is refused."""
    from tests.models import gpt2_hf

    model, inputs = gpt2_hf(batch=2, seq=32)
    model.model.config.use_cache = False
    ref = copy.deepcopy(model)
    torch.manual_seed(3)
    ref(*inputs).loss.backward()
    prepared = prepare(model, inputs)
    plan = partial(plan_eager_mode, model, prepared, budget=None, target="h100",
                   solver=Strategy.GREEDY, solver_options=FAST, blocks=None,
                   example_inputs=inputs)
    everything = plan(activation_budget=10**9).activation_peak
    plan = plan(activation_budget=int(0.8 * everything))
    assert plan.schedule.recomputed  # the checkpoints run ops again
    assert plan.status is Status.HEURISTIC  # a baseline's seed, repaired: nothing proven
    cached = copy.deepcopy(model)
    cached.model.config.use_cache = True
    with pytest.raises(RematError, match="use_cache"):
        plan.apply(cached)
    mine = plan.apply(copy.deepcopy(model))
    torch.manual_seed(3)
    mine(*inputs).loss.backward()
    for (name, a), (_, b) in zip(ref.named_parameters(), mine.named_parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-7, msg=name)


def test_blocks_renumbered_onto_a_sharded_problem_keep_their_order():
    """Sharding inserts collectives among the graph's ops: the blocks' fields follow their ops
    (a position between two ops stays between them, -1 stays before the first)."""
    from remat.solvers.timeline.eager_blocks import EagerBlocks

    blocks = EagerBlocks(ops={"layers.0": (1, 2, 3)}, owner={5: "layers.0"},
                         packer={5: 3, 6: -1}, cacheable=frozenset({2}), node_end={5: 6},
                         position={2: 3.5}, forward_life={1: 3}, state_bytes=7,
                         groups=((2, 3),), unpacks=frozenset({5}))
    index = {0: 0, 1: 2, 2: 3, 3: 4, 4: 6, 5: 8, 6: 9}  # collectives at 1, 5 and 7
    moved = blocks.renumbered(index)
    assert moved.ops == {"layers.0": (2, 3, 4)}
    assert moved.owner == {8: "layers.0"} and moved.packer == {8: 4, 9: -1}
    assert moved.cacheable == {3} and moved.node_end == {8: 9} and moved.groups == ((3, 4),)
    assert moved.position == {3: 4.5} and moved.forward_life == {2: 4}
    assert moved.state_bytes == 7 and moved.unpacks == {8}
