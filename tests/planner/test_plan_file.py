"""Plans as files: `plan.save(path)` and `remat.load_plan(path, model)` in both execution modes,
judged by the loaded plan's schedule and report (equal to the saved plan's) and by its step's
gradients (equal to the original plan's and to eager PyTorch's, dropout on); refused loads
onto other graphs name the first difference; `Schedule` pickles and `Plan` says why not."""
from __future__ import annotations

import copy
import json
import logging
import pickle
import re
from dataclasses import replace

import pytest
import torch

import remat
from remat.errors import RematError
from remat.planner.plans import plan_file
from remat.planner.load_plan import loads_plan
from remat.solvers import SolverOptions, Strategy
from remat.solvers.core import problem_file
from remat.solvers.timeline.evaluate import make_schedule
from examples.llama import LLAMA_TEST, tiny_llama
from tests.ranks import rank_results

CONFIG = LLAMA_TEST
BATCH = 2
FAST = SolverOptions(time_limit=5)
WORLD = 2  # gloo ranks of the broadcast
DEADLINE = 600  # seconds for the whole broadcast job: a rank stuck in a collective fails it


def fresh(config=CONFIG):
    return tiny_llama(config, batch=BATCH)  # the same weights and tokens on every call


def plan_for(model, inputs, execution: str, options: SolverOptions = FAST):
    """The tiny Llama's plan at 70 % of what saving everything holds: it recomputes."""
    everything = remat.optimize(model, activation_budget=10**9, example_inputs=inputs,
                                execution=execution, solver=Strategy.SAVE_ALL if
                                execution == "compiled" else Strategy.OPTIMAL,
                                solver_options=options)
    plan = remat.optimize(model, activation_budget=int(0.7 * everything.activation_peak),
                          example_inputs=inputs, execution=execution, solver_options=options)
    assert plan.recompute_flops > 0, execution
    return plan


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    """A compiled and an eager plan, each saved to a file."""
    model, inputs = fresh()
    out = {}
    for execution in ("compiled", "eager"):
        plan = plan_for(model, inputs, execution)
        path = tmp_path_factory.mktemp("plans") / f"{execution}.json"
        plan.save(path)
        out[execution] = plan, path
    return out


def gradients(model, inputs, plan=None, seed=7):
    """(loss, parameter gradients) of one step of a copy of `model`: plain eager PyTorch, or
    the plan's step (the compiled plan's module for the copy, or the copy wrapped in place)."""
    model = copy.deepcopy(model)
    step = model if plan is None else plan.apply(model)
    torch.manual_seed(seed)  # dropout is on: the same masks in every run
    out = step(*inputs)
    out.backward()
    return float(out.detach()), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("execution", ["compiled", "eager"])
def test_a_saved_plan_loads_as_the_same_plan_and_trains_like_eager(plans, execution):
    plan, path = plans[execution]
    body = json.loads(path.read_text())
    assert body["format"] == "remat.plan" and body["version"] == plan_file.VERSION
    assert body["execution"] == execution and body["mode"] == "train"
    assert body["training"] == plan.training.to_dict()
    assert body["versions"]["torch"] == torch.__version__
    if execution == "eager":
        assert sorted(body["blocks"]) == sorted(plan.policies) == ["layers.0", "layers.1"]
    else:  # the file is also a solver problem and its plan, which replay without torch
        problem, _ = problem_file.loads(json.dumps(body["problem"]))
        entry = body["schedule"]
        replay = make_schedule(problem, entry["recomputed"],
                               recompute_at=dict(entry["recompute_at"]))
        assert replay.peak == plan.schedule.peak and replay.cost == plan.schedule.cost

    model, inputs = fresh()
    loaded = remat.load_plan(path, model)
    assert type(loaded) is type(plan)
    for name in ("saved", "recomputed", "recompute_at", "again", "offload_at", "peak", "cost",
                 "recompute_flops", "status", "bound", "strategy", "budget"):
        assert getattr(loaded.schedule, name) == getattr(plan.schedule, name), name
    assert loaded.peak == plan.peak and loaded.memory == plan.memory
    assert loaded.report().to_dict() == plan.report().to_dict()
    if execution == "eager":
        assert loaded.block_policies == plan.block_policies
    # A second capture of the same model, in this process, hashes to the saved fingerprint.
    assert plan_file.fingerprint(plan_file.graph_ops(loaded.prepared), body["inputs"],
                                 body["kwargs"], "train") == body["fingerprint"]

    plain_loss, plain = gradients(model, inputs)
    planned_loss, planned = gradients(model, inputs, plan)
    loaded_loss, from_file = gradients(model, inputs, loaded)
    assert loaded_loss == planned_loss
    assert abs(loaded_loss - plain_loss) <= 1e-6 * abs(plain_loss)
    for name, grad in plain.items():
        assert torch.equal(from_file[name], planned[name]), name
        torch.testing.assert_close(from_file[name], grad, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("change, first", [
    # Rotary embeddings come first, and their size follows the hidden size.
    ({"hidden": 48}, r"op 0 \('\w+', forward\) differs in shape, bytes: the plan has "
                     r"aten\.arange\.\w+ -> \[8\] int64 \(64 B\), .*; the model has "
                     r"aten\.arange\.\w+ -> \[12\] int64 \(96 B\)"),
    # The third layer's ops are the model's alone, wherever the two steps part.
    ({"layers": 3}, r"the model's step has \d+ ops that the plan's lacks, from its op \d+ on "
                    r"\('\w+' in layers\.2\.attention_norm: .*the planned step has \d+ ops"),
])
def test_a_plan_refuses_another_graph_naming_the_first_difference(plans, change, first):
    _, path = plans["compiled"]
    model, _ = fresh(replace(CONFIG, **change))
    with pytest.raises(RematError) as error:
        remat.load_plan(path, model)
    message = str(error.value)
    assert "this model's training step is not the one" in message
    assert re.search(f"the first difference: {first}", message), message
    assert "the plan has" in message and "remedy:" in message


def test_a_dtype_change_is_named_too(plans):
    _, path = plans["compiled"]
    model, inputs = fresh()
    with pytest.raises(RematError, match=r"differs in .*dtype.* float32 .* float64"):
        remat.load_plan(path, model.double())


def test_wrong_loads_say_what_to_do(plans, tmp_path, caplog):
    plan, path = plans["compiled"]
    model, _ = fresh()
    with pytest.raises(RematError, match=r"in train mode .* call model.train\(\)"):
        remat.load_plan(path, model.eval())
    model.train()
    with pytest.raises(RematError, match="loaded without loss_fn=|without a loss_fn"):
        remat.load_plan(path, model, loss_fn=lambda out: out)
    with pytest.raises(RematError, match=r"other training: optimizer='adamw' \(given 'sgd'\)"):
        remat.load_plan(path, model, training=remat.Training(optimizer="sgd"))
    body = json.loads(path.read_text())
    newer = tmp_path / "newer.json"
    newer.write_text(json.dumps({**body, "version": plan_file.VERSION + 1}))
    with pytest.raises(RematError, match="upgrade remat"):
        remat.load_plan(newer, model)
    with pytest.raises(RematError, match="not a remat plan file"):
        loads_plan('{"format": "remat.problem"}', model)
    # Another torch, the same graph: a warning, and the plan.
    older = tmp_path / "older.json"
    older.write_text(json.dumps({**body, "versions": {**body["versions"], "torch": "2.11.0"}}))
    with caplog.at_level(logging.WARNING, logger="remat.planner.load_plan"):
        loaded = remat.load_plan(older, model)
    assert "made with torch 2.11.0" in caplog.text
    assert loaded.schedule.recomputed == plan.schedule.recomputed


def test_schedules_pickle_and_plans_point_to_files(plans):
    plan, _ = plans["compiled"]
    schedule = pickle.loads(pickle.dumps(plan.schedule))
    assert schedule == plan.schedule and schedule.info == plan.schedule.info
    assert dict(schedule.recompute_at) == dict(plan.schedule.recompute_at)
    with pytest.raises(TypeError, match=r"plan.save\(path\).*remat.load_plan"):
        pickle.dumps(plan)
    eager, _ = plans["eager"]
    assert pickle.loads(pickle.dumps(eager.block_policies)) == eager.block_policies


# ----------------------------------------------------------------------------- broadcast


def _rank(rank: int, init: str, results: str) -> None:
    """One rank: each rank plans for itself; rank 0 sends that compiled plan, then an eager
    one, and every rank trains one step with the plan it has (rank 1 the one it received);
    then a rank whose model differs, and a rank 0 without a plan."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
    try:
        torch.set_num_threads(1)
        out = {}
        model, inputs = fresh()
        # Each rank plans for itself, the solver's determinism left to remat: in a job of
        # several ranks it plans on deterministic time, so both come out with one plan. Rank
        # 0's is also the compiled plan it sends (one plan less to solve on the ranks).
        own = plan_for(model, inputs, "compiled",
                       SolverOptions(time_limit=60, deterministic_time=1))
        out["own plan"] = {"recomputed": sorted(own.schedule.recomputed),
                           "recompute_at": sorted(own.schedule.recompute_at.items()),
                           "deterministic": own.report().solver.deterministic}
        plan = None
        for execution in ("compiled", "eager"):
            mine = None
            if rank == 0:
                mine = own if execution == "compiled" else plan_for(model, inputs, execution)
            plan = remat.broadcast_plan(mine, model=model)
            plain_loss, plain = gradients(model, inputs)
            loss, planned = gradients(model, inputs, plan)
            out[execution] = {
                "type": type(plan).__name__, "report": plan.report().to_dict(),
                "recomputed": sorted(plan.schedule.recomputed), "peak": plan.peak,
                "loss": (loss, plain_loss),
                "worst": max(((planned[n] - g).norm() / g.norm()).item()
                             for n, g in plain.items())}
        other, _ = fresh(replace(CONFIG, hidden=48))
        try:
            remat.broadcast_plan(plan if rank == 0 else None,
                                 model=other if rank == 1 else None)
            out["other model"] = "loaded"
        except RematError as e:
            out["other model"] = str(e)
        try:
            remat.broadcast_plan(None, model=model)
            out["no plan"] = "returned"
        except RematError as e:
            out["no plan"] = str(e)
        torch.save(out, f"{results}.{rank}")
    finally:
        dist.destroy_process_group()


def test_broadcast_plan_runs_rank_0s_plan_on_every_rank():
    ranks = rank_results(_rank, (), WORLD, seconds=DEADLINE)
    for execution in ("compiled", "eager"):
        sent, received = ranks[0][execution], ranks[1][execution]
        assert received["type"] == sent["type"] == ("EagerPlan" if execution == "eager"
                                                    else "Plan")
        assert received["recomputed"] == sent["recomputed"] and sent["recomputed"]
        assert received["report"] == sent["report"] and received["peak"] == sent["peak"]
        for rank in ranks:
            loss, plain_loss = rank[execution]["loss"]
            assert abs(loss - plain_loss) <= 1e-6 * abs(plain_loss), execution
            assert rank[execution]["worst"] <= 1e-5, (execution, rank[execution]["worst"])
    own = [rank["own plan"] for rank in ranks]
    assert own[0]["deterministic"] is True and own[0]["recomputed"], own[0]
    assert own[0] == own[1]
    assert ranks[0]["other model"] == "loaded"  # the sender keeps its own plan
    assert "this model's training step is not the one rank 0's plan was planned for" in \
        ranks[1]["other model"] and "the first difference: op 0" in ranks[1]["other model"]
    for rank in ranks:
        assert "rank 0 sent no plan: rank 0 passed NoneType" in rank["no plan"], rank["no plan"]
