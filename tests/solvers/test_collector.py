"""`frozen_heap`: what exists at entry leaves the collector's scans until the outermost exit;
cyclic garbage made inside is still collected; a caller's own freeze or gc.disable() is left
alone; the planning entries run inside it and leave nothing frozen."""
from __future__ import annotations

import gc
import time
import weakref

import pytest

from remat.solvers import SolverOptions, solve
from remat.solvers.core.collector import frozen_heap
from tests.synthetic.problems import chain


@pytest.fixture(autouse=True)
def thawed():
    """Each test starts and ends with nothing frozen and the collector on."""
    gc.unfreeze()
    gc.enable()
    yield
    gc.unfreeze()
    gc.enable()


class Node:
    def __init__(self):
        self.other = self


def _scanned(obj) -> bool:
    """Whether the collector's generations hold `obj` (the permanent one, frozen, is apart)."""
    return any(x is obj for x in gc.get_objects())


def test_entry_freezes_what_exists_and_the_exit_thaws_it():
    existing = [Node() for _ in range(100)]
    with frozen_heap():
        frozen = gc.get_freeze_count()
        assert frozen >= len(existing)
        assert not any(_scanned(x) for x in existing[:3])
    assert gc.get_freeze_count() == 0
    assert _scanned(existing[0])


def test_nested_entries_freeze_what_was_made_between_and_only_the_outer_thaws():
    with frozen_heap():
        made = Node()
        assert _scanned(made)
        with frozen_heap():
            assert not _scanned(made)
        assert not _scanned(made)  # still frozen: the outer entry owns the freeze
    assert _scanned(made) and gc.get_freeze_count() == 0


def test_cyclic_garbage_made_inside_is_collected_inside():
    with frozen_heap():
        cycle = Node()
        gone = weakref.ref(cycle)
        del cycle
        gc.collect()
        assert gone() is None


def test_an_exception_still_thaws():
    with pytest.raises(RuntimeError):
        with frozen_heap():
            raise RuntimeError("inside")
    assert gc.get_freeze_count() == 0


def test_a_callers_own_freeze_is_left_alone():
    """Objects of theirs stay frozen, and objects made inside are not frozen by remat (the
    frozen count itself moves as frozen objects are freed by reference counting)."""
    theirs = Node()
    gc.freeze()
    with frozen_heap():
        made = Node()
        assert not _scanned(theirs) and _scanned(made)
    assert not _scanned(theirs) and _scanned(made)


def test_a_disabled_collector_is_left_alone():
    gc.disable()
    with frozen_heap():
        assert gc.get_freeze_count() == 0 and not gc.isenabled()
    assert not gc.isenabled()


def test_solve_runs_with_the_heap_frozen_and_leaves_nothing_frozen():
    seen = []

    def clock():  # the solver's deadline reads it: it sees the collector as the solve runs
        if len(seen) < 3:  # get_freeze_count walks every frozen object: a few readings do
            seen.append(gc.get_freeze_count())
        return time.perf_counter()

    problem = chain(layers=4)
    solve(problem, 10 ** 15, "optimal", SolverOptions(time_limit=2, clock=clock))
    assert seen and min(seen) > 0
    assert gc.get_freeze_count() == 0
