"""Offload that overlaps compute: the transfer timeline (`remat.solvers.timeline.overlap`)
worked by hand, its properties on random steps, the simulator's hold of a device copy while its
copy to host runs, and the host-memory bound in the exhaustive search."""
import dataclasses
import random

import pytest

from remat.errors import BudgetError
from remat.solvers import Op, Phase, Problem, make_schedule, simulate
from remat.solvers.timeline.overlap import host_bytes, transfers
from tests.oracles.rich_brute import rich_brute_force
from remat.solvers.core.schedule import recomputable
from remat.solvers.timeline.evaluate import price
from remat.solvers.timeline.simulate import StepKind, step_order
from tests.synthetic.problems import random_problem

F, B = Phase.FORWARD, Phase.BACKWARD


def three_layers(bandwidth: float) -> Problem:
    """a -> b -> c -> loss, and a backward that reads c, then b, then a."""
    return Problem((
        Op("a", F, (), 10, cost=1.0), Op("b", F, (0,), 10, cost=1.0),
        Op("c", F, (1,), 10, cost=4.0), Op("loss", F, (2,), 1, cost=1.0, is_output=True),
        Op("gc", B, (3, 2), 1, cost=1.0), Op("gb", B, (4, 1), 1, cost=2.0),
        Op("ga", B, (5, 0), 1, cost=1.0, is_output=True)), host_bandwidth=bandwidth)


def timeline_of(problem, schedule):
    return transfers(problem, schedule, step_order(problem, schedule))


def test_a_transfer_under_compute_costs_nothing_and_one_without_waits():
    """a (10 bytes, 1 s each way at 10 B/s) is copied out after b, its last forward reader:
    from 2 s to 3 s, under c (2 s to 6 s), so the device copy is held through c and freed
    before loss. Loaded back before gc (issued at 7 s, done at 8 s) it is ready long before ga
    reads it at 10 s: nothing exposed. Loaded just before ga (issued at 10 s), ga waits 1 s."""
    p = three_layers(10.0)
    early = make_schedule(p, [], offload_at={0: 4})
    t = timeline_of(p, early).by_value[0]
    assert (t.out_start, t.out_end, t.in_issued, t.in_end) == (2.0, 3.0, 7.0, 8.0)
    assert (early.cost, early.exposed_time, early.transfer_time) == (0.0, 0.0, 2.0)
    steps = [(p.ops[s.op].name, s.kind.value[0], s.live) for s in simulate(p, early).steps]
    assert steps == [("a", "f", 10), ("b", "f", 20), ("c", "f", 30), ("loss", "f", 21),
                     ("a", "r", 31), ("gc", "b", 32), ("gb", "b", 23), ("ga", "b", 13)]
    late = make_schedule(p, [], offload_at={0: 6})
    assert (late.cost, late.exposed_time) == (1.0, 1.0)
    assert timeline_of(p, late).by_value[0].wait == 1.0
    assert late.peak == 30 < make_schedule(p, []).peak == 32


def test_fifo_copy_streams_and_the_join_at_the_forward_end():
    """At 2.5 B/s a transfer takes 4 s. a goes out 2-6 s, b (after c, at 6 s) 6-10 s: the
    forward ends at 7 s and waits for b's copy to 10 s (3 s exposed). Both loads are issued at
    10 s before gc, FIFO in value order: a 10-14 s, b 14-18 s; gc runs 10-11 s, gb waits for
    b until 18 s (7 s), ga finds a ready. 10 s exposed of 16 s of transfers."""
    p = three_layers(2.5)
    s = make_schedule(p, [], offload_at={0: 4, 1: 4})
    line = timeline_of(p, s)
    a, b = line.by_value[0], line.by_value[1]
    assert (a.out_start, a.out_end, b.out_start, b.out_end) == (2.0, 6.0, 6.0, 10.0)
    assert (a.in_start, a.in_end, b.in_start, b.in_end) == (10.0, 14.0, 14.0, 18.0)
    assert (a.released, b.released) == (2, 3)  # c, loss: the steps that start before the end
    assert (b.wait, line.step_time, line.compute_time) == (7.0, 21.0, 11.0)
    assert (s.exposed_time, s.transfer_time, s.cost) == (10.0, 16.0, 10.0)
    assert line.hidden == 6.0


def _random_schedules(seed: int, bandwidth: float, count: int = 6):
    problem = dataclasses.replace(random_problem(seed, max_forward=8, max_backward=7),
                                  host_bandwidth=bandwidth)
    rng, nf = random.Random(seed), problem.num_forward
    found = []
    for _ in range(20 * count):
        recomputed = [v for v in recomputable(problem) if rng.random() < 0.3]
        try:
            base = make_schedule(problem, recomputed)
            offloads = {}
            for v in sorted(base.saved):
                op = problem.ops[v]
                first = min((r for r in problem.storage_readers[v] if r >= nf), default=None)
                if op.kind.value == "tensor" and op.size and first and rng.random() < 0.5:
                    offloads[v] = rng.randint(nf, first)
            found.append(make_schedule(problem, recomputed, recompute_at=base.recompute_at,
                                       offload_at=offloads))
        except ValueError:
            continue
        if len(found) == count:
            break
    return problem, [s for s in found if s.offload_at]


@pytest.mark.parametrize("seed", range(8))
def test_what_the_step_waits_is_at_most_the_transfers_and_shrinks_with_more_compute(seed):
    """Never more exposed than the transfers' own time; slower compute hides more (never
    less); a link a million times faster hides everything but a sliver; the cost is the
    recomputations plus the exposed time, exactly."""
    problem, schedules = _random_schedules(seed, bandwidth=4.0)
    slower = dataclasses.replace(problem, ops=tuple(
        dataclasses.replace(op, cost=2 * op.cost) for op in problem.ops))
    faster = dataclasses.replace(problem, host_bandwidth=4e6)
    for s in schedules:
        line = timeline_of(problem, s)
        assert 0 <= line.exposed <= line.link_time + 1e-9
        assert line.link_time == pytest.approx(2 * host_bytes(problem, s) / 4.0)
        assert timeline_of(slower, s).exposed <= line.exposed + 1e-9
        assert timeline_of(faster, s).exposed <= line.link_time * 1e-6 + 1e-9
        recompute = sum(problem.ops[v].cost for v in s.recomputed)
        assert price(problem, s)[0] == pytest.approx(recompute + line.exposed, abs=1e-12)


@pytest.mark.parametrize("seed", range(8))
def test_the_device_copy_lives_until_its_copy_to_host_ends(seed):
    """In `simulate`, an offloaded value's device copy is held through every step that starts
    before its copy to host ends, and through no later one; never past the forward."""
    problem, schedules = _random_schedules(seed, bandwidth=4.0)
    for s in schedules:
        line = timeline_of(problem, s)
        order = step_order(problem, s)
        forward_end = max(t for t, (_, kind) in enumerate(order) if kind is StepKind.FORWARD)
        for v, t in line.by_value.items():
            assert t.issued_after <= t.released <= forward_end
            assert line.starts[t.released] < t.out_end or t.released == t.issued_after
            if t.released + 1 < len(order):
                assert line.starts[t.released + 1] >= t.out_end
        # Held longer than with a link so fast that every copy ends at once, never less.
        instant = simulate(dataclasses.replace(problem, host_bandwidth=1e30), s)
        held = simulate(problem, s)
        assert all(h.live >= i.live for h, i in zip(held.steps, instant.steps))


def test_the_host_holds_no_more_than_its_capacity():
    """Over a fast link, keeping a (10 bytes) in host memory fits 30 bytes for free; with 9
    bytes of host memory the exhaustive search must recompute a instead (1 s), and the least
    peak of all (21, offloading b) is out of reach."""
    p = three_layers(1e6)
    free = rich_brute_force(p, 30, max_copies=0)
    assert (free.cost, dict(free.offload_at)) == (0.0, {0: 5})
    capped = dataclasses.replace(p, host_capacity=9)
    paid = rich_brute_force(capped, 30, max_copies=0)
    assert (paid.cost, dict(paid.offload_at), paid.recomputed) == (1.0, {}, {0})
    assert rich_brute_force(p, 21, max_copies=0).offload_at
    with pytest.raises(BudgetError):
        rich_brute_force(capped, 21, max_copies=0)
    with pytest.raises(ValueError, match="host_capacity"):
        Problem(p.ops, host_capacity=-1)
