"""The selective-checkpoint policy function (`decider`): the plan's answer at each position,
the same answer when 2.11 asks again in the recomputation, and an op other than the planned
one refused naming the block, with the op names it caches per op object giving the same
verdicts on a second block."""
import itertools
from types import SimpleNamespace

import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy

from remat.errors import RematError
from remat.fx_passes.eager.block_policy import BlockPolicy
from remat.fx_passes.eager.selective import decider

OPS = ("aten.mm.default", "aten.relu.default", "aten.view.default", "aten.mm.default")
FORWARD, RECOMPUTE = SimpleNamespace(is_recompute=False), SimpleNamespace(is_recompute=True)
ATEN = torch.ops.aten
CALLS = (ATEN.mm.default, ATEN.relu.default, ATEN._unsafe_view.default, ATEN.mm.default)


def policy(path: str, cache: frozenset) -> BlockPolicy:
    return BlockPolicy(path, OPS, tuple((k,) for k in range(len(OPS))), (True,) * len(OPS),
                       cache=cache)


@pytest.mark.parametrize("cache", [frozenset({0, 1}), frozenset({3})])
def test_each_position_gets_the_plans_answer_in_both_passes(cache):
    decide = decider(policy("layers.0", cache), itertools.count())
    expected = [CheckpointPolicy.MUST_SAVE if k in cache else CheckpointPolicy.PREFER_RECOMPUTE
                for k in range(len(OPS))]
    assert [decide(FORWARD, op) for op in CALLS] == expected  # _unsafe_view counts as view
    assert [decide(RECOMPUTE, op) for op in CALLS] == expected


def test_another_op_than_planned_is_refused_naming_the_block():
    decide = decider(policy("layers.1", frozenset()), itertools.count(), lambda: "; because")
    decide(FORWARD, ATEN.mm.default)
    with pytest.raises(RematError, match=r"block 'layers.1': op 1 of the run is "
                                         r"aten.add.Tensor where the plan's capture had "
                                         r"aten.relu.default.*; because"):
        decide(FORWARD, ATEN.add.Tensor)
    more = decider(policy("layers.2", frozenset()), itertools.count())
    for op in CALLS:
        more(FORWARD, op)
    with pytest.raises(RematError, match="op 4 of the run is aten.mm.default where the plan's "
                                         "capture had nothing more"):
        more(FORWARD, ATEN.mm.default)
