"""Plans as files: what `plan.save(path)` writes and `remat.load_plan(path, model)` reads.

A plan file is one JSON object, versioned like the problem files of
`remat.solvers.core.problem_file` (a reader refuses a newer version rather than guess at it):

    {"format": "remat.plan", "version": 1,
     "fingerprint": "sha256:...",     the hash of the planned step's graph (`fingerprint`)
     "versions": {"torch": "2.13.0", "remat": "0.1.0"},
     "model": "Llama", "execution": "compiled" | "eager", "mode": "train" | "eval",
     "target": "h100", "device": "cpu", "replicated": false,
     "inputs": [{"shape": [4, 16], "dtype": "int64"}, 3, null, ...], "kwargs": {...},
     "returns": "output", "loss_fn": null | "module:qualname",
     "training": Training.to_dict(), "budget": bytes | null, "activation_budget": bytes | null,
     "solver": "optimal", "solver_options": {...}, "host_bandwidth": null | bytes/s,
     "parameters": {"name": [[shape], "dtype"], ...},
     "schedule": {"strategy": ..., "status": ..., "peak": ..., "recomputed": [op, ...],
                  "recompute_at": [[op, op], ...], "again": [...], "offload_at": [...], ...},
     "compile": false | true | "blocks", whether plan.module runs the step through Inductor
                                       ("blocks": an eager plan's blocks compiled one by one)
     "inductor": null | {"readings": [{"allowance_cut", "predicted", "measured"}, ...]},
                                       the allocator's readings the compiled plan was accepted on
     "blocks": {"layers.0": BlockPolicy's fields, ...},       (eager plans: their policies)
     "probed": {"unread_inputs": [...], "unused_tensors": [...]},  (eager plans: what the probe
                                                found that the graph does not show)
     "graph": [{"name", "target", "phase", "kind", "shape", "dtype", "bytes", "inputs",
                "module"}, ...],       the joint graph's ops, what the fingerprint hashes
     "problem": a problem file's body: the problem the schedule's op indices number}

The schedule's op indices number `problem` (the graph's ops, with the collectives of ZeRO-2/3
inserted; in an eager plan, the ops as eager runs them), so the file is also a solver problem
with its plan, readable without torch. The fingerprint hashes `graph` without its labels (op
and module names), the input specs and the mode: two captures of the same model, in any
process, give the same one; another hidden size, another layer or another dtype does not.
"""
from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
from pathlib import Path
from typing import Any

from remat.errors import RematError
from remat.planner.job.budget import format_size
from remat.solvers.core import problem_file
from remat.solvers.core.schedule import Schedule

FORMAT = "remat.plan"
VERSION = 1
# What an op of `graph` says about the computation; its name and module are labels.
COMPARED = ("target", "phase", "kind", "shape", "dtype", "bytes", "inputs")
# SolverOptions' fields that are callbacks or objects, not settings a file can hold.
_NOT_SAVED = {"hint", "on_solution", "started"}

__all__ = ["FORMAT", "VERSION", "save", "dumps", "plan_dict", "read", "graph_ops",
           "fingerprint", "first_difference", "example_input", "schedule_json"]


# ----------------------------------------------------------------------------- writing


def save(plan: Any, path: str | Path) -> Path:
    path = Path(path)
    path.write_text(dumps(plan))
    return path


def dumps(plan: Any) -> str:
    return _pretty(plan_dict(plan)) + "\n"


def plan_dict(plan: Any) -> dict:
    """The file's object for `plan` (a `Plan` or an `EagerPlan`)."""
    import torch

    import remat
    from remat.fx_passes.tracing.replicate import ReplicatedCapture

    prepared = plan.prepared
    captured = prepared.captured
    mode = plan.training_mode
    inputs = [_input_json(s, f"example input {i}") for i, s in enumerate(prepared.inputs)]
    kwargs = {k: _input_json(s, f"example_kwargs[{k!r}]") for k, s in prepared.kwargs.items()}
    graph = graph_ops(prepared)
    eager = plan.execution == "eager"
    problem = plan.eager_problem if eager else plan.problem
    options = plan.solver_options
    body = {
        "format": FORMAT, "version": VERSION,
        "fingerprint": fingerprint(graph, inputs, kwargs, mode),
        "versions": {"torch": torch.__version__, "remat": remat.__version__},
        "model": captured.model_name, "execution": plan.execution, "mode": mode,
        "target": plan.target, "device": captured.device,
        "replicated": isinstance(captured, ReplicatedCapture),
        "inputs": inputs, "kwargs": kwargs, "returns": prepared.returns,
        "loss_fn": qualified(prepared.loss_fn),
        "training": plan.training.to_dict(),
        "budget": plan.memory.budget, "activation_budget": plan.activation_budget,
        "solver": plan.solver.value,
        "solver_options": None if options is None else {
            f.name: getattr(options, f.name) for f in dataclasses.fields(options)
            if f.name not in _NOT_SAVED and _is_json(getattr(options, f.name))},
        "host_bandwidth": prepared.problem.host_bandwidth,
        "parameters": {n: [list(shape), dtype] for n, (shape, dtype)
                       in prepared.param_shapes.items()},
        "schedule": schedule_json(plan.schedule),
        "compile": plan.compile,
        "inductor": None if plan.inductor is None else plan.inductor.to_dict(),
    }
    if eager:
        body["blocks"] = {path: _jsonable(dataclasses.asdict(policy))
                          for path, policy in plan.policies.items()}
        body["probed"] = probed_json(plan)
    body["graph"] = graph
    body["problem"] = json.loads(problem_file.dumps(problem))
    return body


def probed_json(plan: Any) -> dict:
    """What an eager plan's probe found that its graph does not show (inputs the blocks never
    read, tensors no op reads: `EagerBlocks.unread_inputs`, `unused_tensors`), their ops as
    joint-graph ops, so that a load, which runs no probe, predicts the same memory."""
    structure, to_graph = plan.structure, plan.to_graph

    def graph_op(v: int) -> int:
        return v if v < 0 else to_graph[v]  # -1: before the first op

    return {"unread_inputs": [[size, list(names)] for size, names in structure.unread_inputs],
            "unused_tensors": [[size, graph_op(first), graph_op(last), made]
                               for size, first, last, made in structure.unused_tensors]}


def schedule_json(schedule: Schedule) -> dict:
    """The schedule's decisions by op index, its figures, and the JSON part of its `info`."""
    info = {k: _jsonable(v) for k, v in schedule.info.items() if _is_json(_jsonable(v))}
    return {
        "strategy": schedule.strategy, "status": schedule.status.value, "cost": schedule.cost,
        "recompute_flops": schedule.recompute_flops, "peak": schedule.peak,
        "budget": schedule.budget, "bound": schedule.bound, "solve_time": schedule.solve_time,
        "transfer_time": schedule.transfer_time, "exposed_time": schedule.exposed_time,
        "saved": sorted(schedule.saved), "recomputed": sorted(schedule.recomputed),
        "recompute_at": sorted([v, b] for v, b in schedule.recompute_at.items()),
        "again": sorted([v, list(ps)] for v, ps in schedule.again.items()),
        "offload_at": sorted([v, b] for v, b in schedule.offload_at.items()),
        "info": info,
    }


def graph_ops(prepared: Any) -> list[dict]:
    """The planned step's joint-graph ops as the fingerprint sees them: what each computes
    (target), its output's shape, dtype and bytes, and what it reads (op indices)."""
    from remat.fx_passes.lowering.lower import op_nodes

    graph = prepared.sharded.graph
    nodes = op_nodes(prepared.captured, graph)
    ops = []
    for op, node in zip(graph.ops, nodes):
        shape, dtype = _tensor_meta(node.meta.get("val"))
        ops.append({"name": op.name, "target": op.target, "phase": op.phase.value,
                    "kind": op.kind.value, "shape": shape, "dtype": dtype, "bytes": op.size,
                    "inputs": list(op.inputs), "module": op.module})
    return ops


def fingerprint(graph: list[dict], inputs: list, kwargs: dict, mode: str) -> str:
    """sha256 of the graph's computation (`COMPARED` of every op), the input specs and the
    mode, in a canonical JSON: the same for every capture of the same model and inputs."""
    body = {"ops": [[op[k] for k in COMPARED] for op in graph], "inputs": inputs,
            "kwargs": kwargs, "mode": mode}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


# ----------------------------------------------------------------------------- reading


def read(text: str, source: str = "the plan file") -> dict:
    """The file's object, its format and version checked."""
    try:
        body = json.loads(text)
    except json.JSONDecodeError as e:
        raise RematError(f"{source} is not JSON ({e}); a plan file is what plan.save(path) "
                         "or `remat plan ... --out FILE` writes") from None
    if not isinstance(body, dict) or body.get("format") != FORMAT:
        found = body.get("format") if isinstance(body, dict) else type(body).__name__
        raise RematError(f"{source} is not a remat plan file (format {found!r}); a plan file "
                         "is what plan.save(path) or `remat plan ... --out FILE` writes")
    if body.get("version") != VERSION:
        raise RematError(f"{source} is a plan file of version {body.get('version')!r}; this "
                         f"remat reads version {VERSION}: upgrade remat, or plan again")
    return body


def example_input(spec: Any, device: str) -> Any:
    """An example input of the saved spec: zeros of its shape and dtype on `device` for a
    tensor (capturing reads shapes and dtypes, never values), the value itself otherwise."""
    import torch

    if isinstance(spec, dict) and set(spec) == {"shape", "dtype"}:
        dtype = getattr(torch, spec["dtype"], None)
        if not isinstance(dtype, torch.dtype):
            raise RematError(f"the plan file names dtype {spec['dtype']!r}, which this torch "
                             "does not have")
        return torch.zeros(spec["shape"], dtype=dtype, device=device)
    return spec


def first_difference(saved: list[dict], now: list[dict]) -> str:
    """Where the model's step first departs from the planned one, in words: the first op
    that differs, or the first run of ops that one step has and the other lacks (an extra
    layer shifts every later op, so the two are aligned first)."""
    first = next((i for i, (a, b) in enumerate(zip(saved, now))
                  if any(a[k] != b[k] for k in COMPARED)), min(len(saved), len(now)))
    if len(saved) != len(now):
        # Aligned by what each op computes and where (its inputs are indices, which a run of
        # extra ops shifts; the module tells the blocks apart): the first run that only one
        # side has, if it starts where the two part.
        key = lambda op: tuple(json.dumps(op[k]) for k in (*COMPARED, "module")  # noqa: E731
                               if k != "inputs")
        matcher = difflib.SequenceMatcher(None, [key(op) for op in saved],
                                          [key(op) for op in now], autojunk=False)
        tag, i1, i2, j1, j2 = next(op for op in matcher.get_opcodes() if op[0] != "equal")
        if tag in ("insert", "delete") and min(i1, j1) <= first:
            ops, start, count, who, other = ((now, j1, j2 - j1, "the model's step", "plan")
                                             if tag == "insert" else
                                             (saved, i1, i2 - i1, "the planned step", "model"))
            return (f"{who} has {count} ops that the {other}'s lacks, from its op {start} on "
                    f"({_label(ops[start])}: {_describe(ops[start], ops)}); the planned step "
                    f"has {len(saved)} ops, the model's {len(now)}")
    if first < min(len(saved), len(now)):
        a, b = saved[first], now[first]
        differ = [k for k in COMPARED if a[k] != b[k]]
        return (f"op {first} ({_label(a)}, {a['phase']}) differs in {', '.join(differ)}: the "
                f"plan has {_describe(a, saved)}; the model has {_describe(b, now)}")
    if len(saved) == len(now):
        return "no op differs: the example inputs or the mode do"
    longer = saved if len(saved) > len(now) else now
    return (f"the planned step has {len(saved)} ops and the model's {len(now)}; the first "
            f"{first} agree, then {_label(longer[first])}: {_describe(longer[first], longer)}")


def parameters_difference(saved: dict, now: dict) -> str | None:
    """The first parameter whose name, shape or dtype differs, in words (None: none)."""
    now = {n: [list(shape), dtype] for n, (shape, dtype) in now.items()}
    for name in [*saved, *(n for n in now if n not in saved)]:
        a, b = saved.get(name), now.get(name)
        if a != b:
            said = lambda x: "nothing" if x is None else f"{tuple(x[0])} {x[1]}"  # noqa: E731
            return f"parameter {name!r}: the plan has {said(a)}, the model {said(b)}"
    return None


# ----------------------------------------------------------------------------- helpers


def _label(op: dict) -> str:
    return repr(op["name"]) + (f" in {op['module']}" if op["module"] else "")


def _describe(op: dict, ops: list[dict]) -> str:
    reads = ", ".join(f"{j} {ops[j]['name']!r}" if 0 <= j < len(ops) else str(j)
                      for j in op["inputs"])
    return (f"{op['target']} -> {op['shape']} {op['dtype']} ({format_size(op['bytes'])}), "
            f"{op['kind']}, reading [{reads}]")


def _tensor_meta(val: Any) -> tuple[Any, Any]:
    """(shape, dtype) of a node's fake value; lists of them for a tuple."""
    import torch

    if isinstance(val, torch.Tensor):
        shape = [int(s) if isinstance(s, int) or str(s).isdigit() else str(s)
                 for s in val.shape]
        return shape, str(val.dtype).removeprefix("torch.")
    if isinstance(val, (tuple, list)):
        metas = [_tensor_meta(v) for v in val]
        return [m[0] for m in metas], [m[1] for m in metas]
    return None, (None if val is None else type(val).__name__)


def _input_json(spec: Any, what: str) -> Any:
    import torch

    if isinstance(spec, tuple) and len(spec) == 2 and isinstance(spec[1], torch.dtype):
        return {"shape": list(spec[0]), "dtype": str(spec[1]).removeprefix("torch.")}
    if not _is_json(spec) or isinstance(spec, (list, dict)):
        raise RematError(f"plan.save: {what} is a {type(spec).__name__}, which a plan file "
                         "cannot hold (tensors, numbers, strings, booleans and None it can): "
                         "pass it through loss_fn= or make it a tensor input")
    return spec


def qualified(fn: Any) -> str | None:
    """"module:qualname" of a function, what a file keeps of a loss_fn."""
    if fn is None:
        return None
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', type(fn).__name__)}"


def _jsonable(value: Any) -> Any:
    """Tuples as lists and sets as sorted lists, all the way down."""
    if isinstance(value, (set, frozenset)):
        return sorted(_jsonable(v) for v in value)
    if isinstance(value, (tuple, list)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    return value


def _is_json(value: Any) -> bool:
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError):
        return False
    return True


def _pretty(value: Any, depth: int = 0) -> str:
    """JSON a person can read and diff: the file's sections one key a line, and each op,
    block or decision on a line of its own."""
    pad, close = " " * (depth + 1), " " * depth
    if isinstance(value, dict) and value and depth < 2:
        items = [f"{pad}{json.dumps(k)}: {_pretty(v, depth + 1)}" for k, v in value.items()]
        return "{\n" + ",\n".join(items) + "\n" + close + "}"
    if isinstance(value, list) and value and all(isinstance(x, (dict, list)) for x in value):
        items = [pad + json.dumps(x, separators=(", ", ": ")) for x in value]
        return "[\n" + ",\n".join(items) + "\n" + close + "]"
    return json.dumps(value)
