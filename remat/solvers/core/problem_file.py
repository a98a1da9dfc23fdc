"""Problems as JSON files: how solver bugs get reproduced and the regression corpus is kept.

The format, version 1, is one JSON object:

    {"format": "remat.problem", "version": 1, "name": "...", "source": {...},
     "ops": [{"name": "mm_3", "phase": "forward", "inputs": [1, 2], "size": 4096, ...}, ...],
     ...anything else the writer adds (budgets and recorded costs, for instance)}

Each op carries the fields of `remat.solvers.core.problem.Op` under the same names; a field at its
default value is left out (`kind` "tensor", `temp` 0, `cost` 0, `flops` 0,
`not_recomputable` null, `is_output` false, `module` and `target` ""). Enum fields are written
as their values. A reader refuses a newer version rather than guess at it.
"""
from __future__ import annotations

import dataclasses
import json

from remat.solvers.core.problem import Kind, Op, Phase, Problem, Reason

FORMAT = "remat.problem"
VERSION = 1
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(Op) if f.default is not dataclasses.MISSING}


def dumps(problem: Problem, **extra) -> str:
    ops = []
    for op in problem.ops:
        entry = {}
        for f in dataclasses.fields(Op):
            value = getattr(op, f.name)
            if f.name in _DEFAULTS and value == _DEFAULTS[f.name]:
                continue
            if isinstance(value, (Phase, Kind, Reason)):
                value = value.value
            elif isinstance(value, tuple):
                value = list(value)
            entry[f.name] = value
        ops.append(entry)
    reserved = {"format", "version", "name", "source", "ops", "host_bandwidth",
                "host_capacity"} & extra.keys()
    if reserved:
        raise ValueError(f"extra fields may not be named {sorted(reserved)}")
    body = {"format": FORMAT, "version": VERSION, "name": problem.name,
            "source": problem.source, **extra, "ops": ops}
    if problem.host_bandwidth is not None:
        body["host_bandwidth"] = problem.host_bandwidth
    if problem.host_capacity is not None:
        body["host_capacity"] = problem.host_capacity
    return json.dumps(body, separators=(",", ":"))


def loads(text: str) -> tuple[Problem, dict]:
    """The problem and the writer's extra fields."""
    body = json.loads(text)
    if body.get("format") != FORMAT:
        raise ValueError(f"not a remat problem file (format {body.get('format')!r})")
    if body.get("version") != VERSION:
        raise ValueError(f"problem file version {body.get('version')!r}; this remat reads "
                         f"version {VERSION}: upgrade remat or re-save the problem")
    ops = []
    for i, entry in enumerate(body["ops"]):
        fields = dict(entry)
        try:
            fields["phase"] = Phase(fields["phase"])
            fields["inputs"] = tuple(fields.get("inputs", ()))
            fields["kind"] = Kind(fields.get("kind", Kind.TENSOR))
            if fields.get("not_recomputable") is not None:
                fields["not_recomputable"] = Reason(fields["not_recomputable"])
            ops.append(Op(**fields))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"op {i} of the problem file is malformed: {exc}") from None
    own = {"format", "version", "name", "source", "ops", "host_bandwidth", "host_capacity"}
    extra = {k: v for k, v in body.items() if k not in own}
    return Problem(tuple(ops), name=body.get("name", ""), source=body.get("source", {}),
                   host_bandwidth=body.get("host_bandwidth"),
                   host_capacity=body.get("host_capacity")), extra
