"""Problem validation and the JSON file format."""
import json

import pytest

from remat.solvers import Kind, Op, Phase, Problem, Reason
from remat.solvers.core.problem_file import dumps, loads

F, B = Phase.FORWARD, Phase.BACKWARD


@pytest.mark.parametrize("ops, message", [
    ([Op("a", F, (0,), 1)], "comes at or after the op itself"),
    ([Op("a", F, (), 1), Op("b", F, (2,), 1), Op("c", F, (0,), 1)], "comes at or after"),
    ([Op("a", F, (), -1)], "size must be a non-negative int"),
    ([Op("a", F, (), 1, cost=float("nan"))], "cost must be a finite"),
    ([Op("a", B, (), 1), Op("b", F, (0,), 1)], "a forward op after a backward op"),
    ([Op("a", F, (), 1), Op("a", F, (0,), 1)], "the name is used by an earlier op"),
    ([Op("a", F, (), 1), Op("v", F, (0,), 4, kind=Kind.VIEW)], "a view owns no bytes"),
    ([Op("t", F, (), kind=Kind.TUPLE, temp=4), Op("x", F, (0, 0), 4)], "may read the tuple op"),
    ([Op("a", F, (), 1), Op("g", B, (0,), 1, forward_output=True)], "cannot be a forward output"),
])
def test_malformed_problems_name_the_op(ops, message):
    with pytest.raises(ValueError, match=message):
        Problem(tuple(ops))


def test_json_round_trip_keeps_every_field_and_extras():
    problem = Problem((
        Op("t", F, (), kind=Kind.TUPLE, temp=24, cost=1e-6, flops=10,
           not_recomputable=Reason.RANDOM, module="h.0.drop", target="aten.native_dropout"),
        Op("x", F, (0,), 16, not_recomputable=Reason.INHERITED),
        Op("xt", F, (1,), kind=Kind.VIEW),
        Op("stat", F, (1,), 8, forward_output=True),
        Op("loss", F, (2,), 4, is_output=True),
        Op("gx", B, (4, 2), 16, is_output=True, cost=2e-6, flops=20),
    ), name="tiny", source={"model": "hand"})
    text = dumps(problem, cases=[{"budget": 100, "cost": 0.0}])
    again, extra = loads(text)
    assert again == problem and again.source == {"model": "hand"} and again.name == "tiny"
    assert extra == {"cases": [{"budget": 100, "cost": 0.0}]}


def test_json_refuses_other_versions_and_malformed_ops():
    body = json.loads(dumps(Problem((Op("a", F, (), 1),))))
    with pytest.raises(ValueError, match="version 2"):
        loads(json.dumps({**body, "version": 2}))
    body["ops"][0]["phase"] = "sideways"
    with pytest.raises(ValueError, match="op 0 of the problem file is malformed"):
        loads(json.dumps(body))


def test_candidates_resolve_views_to_their_base():
    problem = Problem((Op("a", F, (), 8), Op("at", F, (0,), kind=Kind.VIEW),
                       Op("loss", F, (1,), 4, is_output=True), Op("g", B, (1,), 8)))
    assert problem.root == (0, 0, 2, 3)
    assert problem.candidates == (0,)
