"""`match_problem` reads a graph's bytes that are symbolic in type only (a SymInt whose
expression is a constant, as the storage pass gives DBRX's experts once their data-dependent
sizes are fixed) as the numbers they are: equal ones match, others are refused."""
from __future__ import annotations

import pytest
import sympy
import torch
from torch.fx.experimental.sym_node import SymNode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from remat.errors import RematError
from remat.fx_passes.compiled.joint_graph import match_problem
from remat.fx_passes.lowering.lower import lower
from remat.fx_passes.measuring.storage import remat_meta
from remat.fx_passes.tracing.capture import capture


def _constant_symint(value: int) -> torch.SymInt:
    return torch.SymInt(SymNode(sympy.Integer(value), ShapeEnv(), int, value))


@pytest.fixture(scope="module")
def step():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    captured = capture(model, (torch.randn(4, 8),), loss_fn=lambda out: out.sum())
    return captured.graph_module, lower(captured)


def _owning_call(joint):
    return next(n for n in joint.graph.nodes if n.op == "call_function"
                and isinstance(remat_meta(n).get("bytes"), int) and remat_meta(n)["bytes"] > 0
                and remat_meta(n).get("alias_of") is None and not remat_meta(n).get("view_tuple")
                and not isinstance(n.meta.get("val"), (tuple, list)))


def test_a_constant_symint_of_the_same_bytes_matches(step):
    joint, problem = step
    node = _owning_call(joint)
    meta = remat_meta(node)
    size = meta["bytes"]
    meta["bytes"] = _constant_symint(size)
    try:
        assert len(match_problem(joint, problem)) == len(problem.ops)
    finally:
        meta["bytes"] = size


def test_a_constant_symint_of_other_bytes_is_refused(step):
    joint, problem = step
    node = _owning_call(joint)
    meta = remat_meta(node)
    size = meta["bytes"]
    meta["bytes"] = _constant_symint(size + 4)
    try:
        with pytest.raises(RematError, match=rf"holds {size} bytes in the problem but "
                                             rf"{size + 4} in the graph"):
            match_problem(joint, problem)
    finally:
        meta["bytes"] = size
