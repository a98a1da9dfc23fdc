"""`remat.load_plan(path, model)`: a plan file (`plan.save`, `remat.planner.plans.plan_file`) made a
`Plan` again, on a model, without solving.

The model's step is captured with the saved input specs and profiled for the saved target,
its graph hashed and checked against the saved fingerprint (a difference is an error naming
the first op that differs), and the saved schedule evaluated on it: the loaded plan is the
plan that was saved, with its report, `module` and `apply` (eager: `apply` with the saved
block policies).
"""
from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any, Callable

from remat.errors import RematError
from remat.planner.plans import plan_file
from remat.planner.job.budget import format_size
from remat.planner.plans.eager_plan import EagerPlan, eager_step
from remat.planner.plans.plan import Plan
from remat.planner.plans.prepare import device_of, prepare
from remat.planner.job.training import Training
from remat.solvers import SolverOptions, Strategy
from remat.solvers.core import problem_file
from remat.solvers.timeline.eager import eager_schedule
from remat.solvers.core.schedule import Status
from remat.solvers.timeline.evaluate import make_schedule

log = logging.getLogger(__name__)

__all__ = ["load_plan", "loads_plan"]

REMEDY = ("load the plan onto the model it was made for (configuration, dtype, inputs, "
          "device), or plan this model with remat.optimize")


def load_plan(path: str | Path, model: Any, *, loss_fn: Callable | None = None,
              training: Training | None = None) -> Plan:
    """The plan saved at `path` (by ``plan.save(path)`` or ``remat plan ... --out``), made
    for `model`: a `Plan` (an `EagerPlan` for an eager one) whose schedule is the saved one,
    nothing solved. `model` is captured again with the saved input shapes, in the saved mode,
    on its device; a step that differs from the planned one (another hidden size, another
    layer, another dtype) raises RematError naming the first op that differs. A plan made
    with a ``loss_fn`` needs it again (a file holds its name only), and one made with
    ``Training(frozen=<predicate>)`` needs that `training` again; a `training` given must be
    the saved one. A plan saved by another torch version loads with a warning when the graph
    is the same."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise RematError(f"load_plan: cannot read {path}: {e.strerror or e}") from None
    return loads_plan(text, model, loss_fn=loss_fn, training=training, source=str(path))


def loads_plan(text: str, model: Any, *, loss_fn: Callable | None = None,
               training: Training | None = None, source: str = "the plan") -> Plan:
    """`load_plan` of a plan file's text (what `remat.planner.plans.plan_file.dumps` writes)."""
    body = plan_file.read(text, source)
    mode = "train" if model.training else "eval"
    if mode != body["mode"]:
        raise RematError(f"load_plan: {source} was made with the model in {body['mode']} mode "
                         f"and this model is in {mode} mode (dropout and BatchNorm trace other "
                         f"graphs): call model.{body['mode']}() before loading")
    _check_loss_fn(body, loss_fn, source)
    training = _training(body, training, source)
    where = device_of(model)
    _check_device(body, where, source)
    inputs = tuple(plan_file.example_input(s, where) for s in body["inputs"])
    kwargs = {k: plan_file.example_input(s, where) for k, s in body["kwargs"].items()}
    prepared = prepare(model, inputs, example_kwargs=kwargs, training=training,
                       target=body["target"], loss_fn=loss_fn, returns=body["returns"],
                       replicate=body["replicated"],
                       inductor=bool(body.get("compile")) and body["execution"] == "compiled")
    if body["host_bandwidth"] is not None:
        prepared = prepared.with_host_link(body["host_bandwidth"], training.host_memory)
    _check_graph(body, prepared, source)

    entry = body["schedule"]
    fields = dict(model=model, prepared=prepared, target=body["target"],
                  solver=Strategy(body["solver"]),
                  solver_options=_solver_options(body["solver_options"]),
                  activation_budget=body["activation_budget"])
    if body["execution"] == "eager":
        policies = {path: _block_policy(d) for path, d in body["blocks"].items()}
        structure, policies, problem, to_graph = eager_step(prepared, list(policies),
                                                            policies=policies,
                                                            probed=_probed(body),
                                                            for_compile=bool(body.get("compile")))
        _check_problem(body, problem, source)
        schedule = eager_schedule(problem, structure, entry["info"]["cached"],
                                  offload=entry["info"].get("offload", ()),
                                  strategy=entry["strategy"], status=Status(entry["status"]),
                                  budget=entry["budget"])
        # The solver's notes (who answered, where the bound came from) as saved; the
        # timeline's own entries (the cached set) as rebuilt here.
        schedule = dataclasses.replace(schedule, bound=entry["bound"],
                                       solve_time=entry["solve_time"],
                                       info={**entry["info"], **schedule.info})
        extra = dict(policies=policies, structure=structure, eager_problem=problem,
                     to_graph=to_graph)
    else:
        problem = prepared.problem
        _check_problem(body, problem, source)
        try:
            schedule = make_schedule(
                problem, entry["recomputed"], recompute_at=dict(entry["recompute_at"]),
                again=dict(entry["again"]), offload_at=dict(entry["offload_at"]),
                strategy=entry["strategy"], status=Status(entry["status"]),
                budget=entry["budget"], bound=entry["bound"], solve_time=entry["solve_time"],
                info=entry["info"])
        except ValueError as e:
            raise RematError(f"load_plan: the schedule of {source} cannot run on this model's "
                             f"step ({e}); {REMEDY}") from None
        extra = {}
    _check_schedule(entry, schedule, source)
    memory = prepared.step_memory(schedule, body["budget"])
    kind = EagerPlan if body["execution"] == "eager" else Plan
    plan = kind(schedule=schedule, memory=memory, **fields, **extra)
    _compiled_as_saved(plan, body)
    _warn_over_budget(plan, entry, source)
    log.info("loaded %s: %s", source, plan)
    return plan


# ----------------------------------------------------------------------------- checks


def _compiled_as_saved(plan: Plan, body: dict) -> None:
    """A plan saved with compile=True runs under Inductor again, its peak the one its
    readings accepted (files written before the option have neither key)."""
    if not body.get("compile"):
        return
    from remat.planner.plans.inductor_check import InductorCheck

    plan.compile = body["compile"]
    if body.get("inductor"):
        plan.inductor = InductorCheck.from_dict(body["inductor"])
        plan.memory = dataclasses.replace(plan.memory, compiled_excess=plan.inductor.excess)


def _check_loss_fn(body: dict, loss_fn: Callable | None, source: str) -> None:
    saved = body["loss_fn"]
    if saved is not None and loss_fn is None:
        raise RematError(f"load_plan: {source} was made with loss_fn={saved}, which a file "
                         "cannot hold: pass loss_fn= to load_plan")
    if saved is None and loss_fn is not None:
        raise RematError(f"load_plan: {source} was made without a loss_fn (the model returns "
                         "its loss); load it without loss_fn=")
    if loss_fn is not None and plan_file.qualified(loss_fn) != saved:
        log.warning("load_plan: the plan was made with loss_fn=%s and is loaded with %s; the "
                    "graphs are compared, not the names", saved, plan_file.qualified(loss_fn))


def _training(body: dict, training: Training | None, source: str) -> Training:
    saved = body["training"]
    if training is None:
        if saved["frozen"] == "<predicate>":
            raise RematError(f"load_plan: {source} was made with Training(frozen=<a "
                             "predicate>), which a file cannot hold: pass training= (the "
                             "Training it was planned with) to load_plan")
        try:
            return Training(**saved)
        except (TypeError, ValueError) as e:
            raise RematError(f"load_plan: {source} has a training configuration this remat "
                             f"cannot read ({e}): pass training= to load_plan") from None
    given = training.to_dict()
    differ = sorted(k for k in set(saved) | set(given) if saved.get(k) != given.get(k))
    if differ:
        said = ", ".join(f"{k}={saved.get(k)!r} (given {given.get(k)!r})" for k in differ)
        raise RematError(f"load_plan: {source} was planned for other training: {said}; a "
                         "plan holds for the training it was made for: load it without "
                         "training=, or plan this configuration with remat.optimize")
    return training


def _check_device(body: dict, where: str, source: str) -> None:
    import torch

    planned = body["device"]
    if where and planned and torch.device(where).type != torch.device(planned).type:
        raise RematError(
            f"load_plan: {source} was made on {planned} and the model is on {where}; PyTorch "
            "runs other ops on other devices (attention, dropout), so a plan holds on the "
            "device kind it was made on: move the model there before loading (and apply the "
            "plan after moving it), or plan on the device you train on")


def _check_graph(body: dict, prepared: Any, source: str) -> None:
    import torch

    graph = plan_file.graph_ops(prepared)
    now = plan_file.fingerprint(graph, body["inputs"], body["kwargs"], body["mode"])
    then_torch = body["versions"]["torch"]
    parameters = plan_file.parameters_difference(body["parameters"], prepared.param_shapes)
    if now != body["fingerprint"]:
        lines = [f"load_plan: this model's training step is not the one {source} was planned "
                 f"for ({body['model']}, {len(body['graph'])} ops, fingerprint "
                 f"{body['fingerprint'][:19]}...; this model's: {len(graph)} ops, "
                 f"{now[:19]}...)",
                 f"  the first difference: {plan_file.first_difference(body['graph'], graph)}"]
        if parameters:
            lines.append(f"  the parameters differ too: {parameters}")
        if then_torch != torch.__version__:
            lines.append(f"  the plan was made with torch {then_torch}, this is "
                         f"{torch.__version__}: another torch may trace the same model to "
                         "other ops")
        lines.append(f"  remedy: {REMEDY}")
        raise RematError("\n".join(lines))
    if parameters:
        raise RematError(f"load_plan: this model computes the planned step, but its parameters "
                         f"are named otherwise ({parameters}); plan.apply(model) needs the "
                         f"planned names: {REMEDY}")
    if then_torch != torch.__version__:
        log.warning("load_plan: %s was made with torch %s and this is %s; the graph is the same "
                    "(fingerprint %s), so the plan holds", source, then_torch,
                    torch.__version__, now)


def _check_problem(body: dict, problem: Any, source: str) -> None:
    """The problem the schedule numbers, made again, has the saved one's ops (with the same
    configuration, the collectives and eager's bytes follow from the graph)."""
    saved, _ = problem_file.loads(json.dumps(body["problem"]))
    shape = lambda p: [(op.phase, op.kind, op.inputs, op.size) for op in p.ops]  # noqa: E731
    if shape(saved) != shape(problem):
        first = next((i for i, (a, b) in enumerate(zip(shape(saved), shape(problem)))
                      if a != b), min(len(saved), len(problem)))
        raise RematError(f"load_plan: the problem the schedule of {source} numbers "
                         f"({len(saved)} ops) differs from this model's ({len(problem)} ops) "
                         f"from op {first} on, though the graphs agree; {REMEDY}")
    then, now = sum(op.cost for op in saved.ops), sum(op.cost for op in problem.ops)
    if abs(then - now) > 1e-9 * max(then, now):
        log.warning("load_plan: the ops' times differ from the saved plan's (%.4g s of ops, "
                    "was %.4g s: measured on another machine?); the loaded plan's cost is "
                    "this machine's, its status and bound the saved solve's", now, then)


def _check_schedule(entry: dict, schedule: Any, source: str) -> None:
    for name in ("saved", "recomputed"):
        if sorted(getattr(schedule, name)) != entry[name]:
            raise RematError(f"load_plan: the schedule of {source}, evaluated on this model's "
                             f"step, {name} other values than it says; {REMEDY}")
    if schedule.peak != entry["peak"]:
        log.warning("load_plan: the plan's simulated peak on this machine is %s, %s when "
                    "saved (kernel scratch measured here differs)",
                    format_size(schedule.peak), format_size(entry["peak"]))


def _warn_over_budget(plan: Plan, entry: dict, source: str) -> None:
    allowance = plan.prepared.allowance(plan.memory.budget, plan.activation_budget)
    if plan.schedule.peak > allowance and entry["peak"] <= allowance:
        log.warning("load_plan: on this machine %s's step exceeds its budget (simulated peak "
                    "%s, allowance %s): plan again here with remat.optimize", source,
                    format_size(plan.schedule.peak), format_size(allowance))


# ----------------------------------------------------------------------------- parts


def _solver_options(saved: dict | None) -> SolverOptions | None:
    if saved is None:
        return None
    known = {f.name for f in dataclasses.fields(SolverOptions)}
    unknown = sorted(set(saved) - known)
    if unknown:
        log.warning("load_plan: solver options %s of the saved plan are unknown to this "
                    "remat; a re-plan (plan.apply on another device) runs without them",
                    unknown)
    return SolverOptions(**{k: v for k, v in saved.items() if k in known})


def _probed(body: dict) -> tuple[tuple, tuple]:
    """What the saved plan's probe found (`plan_file.probed_json`; nothing in files saved
    before it was kept)."""
    probed = body.get("probed", {})
    return (tuple((size, tuple(names)) for size, names in probed.get("unread_inputs", ())),
            tuple((size, first, last, bool(made))
                  for size, first, last, made in probed.get("unused_tensors", ())))


def _block_policy(saved: dict):
    """A BlockPolicy from its saved fields: lists back to tuples, the cache a frozenset."""
    from remat.fx_passes.eager.block_policy import BlockPolicy

    fields = {f.name: f for f in dataclasses.fields(BlockPolicy)}
    unknown = sorted(set(saved) - set(fields))
    if unknown:
        raise RematError(f"load_plan: the plan's block policies have fields {unknown}, which "
                         "this remat does not know: load it with the remat that saved it")

    def tuples(value):
        return tuple(tuples(v) for v in value) if isinstance(value, list) else value

    return BlockPolicy(**{k: frozenset(v) if "frozenset" in str(fields[k].type) else tuples(v)
                          for k, v in saved.items()})
