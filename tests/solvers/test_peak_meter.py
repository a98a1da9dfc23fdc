"""PeakMeter, the fast peak of the baselines' searches, against the simulator: the same peak
for every decision and placement, and the same needed sets as `needed_storages`."""
import random

from hypothesis import HealthCheck, given, settings, strategies as st

from remat.solvers import Kind, make_schedule, simulate
from remat.solvers.timeline.peak_meter import PeakMeter
from remat.solvers.core.problem import needed_storages, tuple_of
from remat.solvers.core.schedule import drop_unneeded, recomputable
from tests.synthetic.problems import Builder, random_problem, transformer


def earlier_positions(problem, schedule, rng):
    """Valid positions at or before the just-in-time ones, drawn at random: every value before
    its recomputed readers, every tensor of a tuple op where the tuple op is."""
    nf = problem.num_forward
    pos = {}
    for v in sorted(schedule.recomputed, reverse=True):
        cap = schedule.recompute_at[v]
        cap = min([cap] + [pos[r] for r in problem.storage_readers[v] if r in pos])
        if problem.ops[v].kind is Kind.TUPLE:
            cap = min(pos[g] for g in problem.users[v] if g in pos)
        pos[v] = rng.randint(nf, cap)
        if problem.ops[v].kind is Kind.TUPLE:
            for g in problem.users[v]:
                if g in pos:
                    pos[g] = pos[v]
    return pos


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2 ** 32 - 1), share=st.floats(0, 1))
def test_the_peak_is_the_simulated_peak(seed, share):
    problem = random_problem(seed, max_forward=14, max_backward=10)
    rng = random.Random(seed)
    meter = PeakMeter(problem)
    chosen = [v for v in recomputable(problem) if rng.random() < share]
    recomputed = meter.drop_unneeded(chosen)
    assert recomputed == drop_unneeded(problem, chosen)
    assert meter.needed(recomputed) == needed_storages(problem, recomputed)
    schedule = make_schedule(problem, recomputed)
    assert meter.peak(recomputed) == simulate(problem, schedule).peak
    assert meter.cost(recomputed) == sum(problem.ops[v].cost for v in schedule.recomputed)
    placed = make_schedule(problem, recomputed,
                           recompute_at=earlier_positions(problem, schedule, rng))
    assert meter.peak(recomputed, placed.recompute_at) == placed.peak


def backward_tuples():
    """Tuple ops in the backward, one of whose tensors nobody reads (held one step, after its
    tuple op's, which can be a recomputation placed before the next backward op)."""
    g = Builder()
    a = g.add("a", [], 100, cost=1.0)
    b = g.add("b", [a], 30, cost=1.0)
    c = g.add("c", [b], 50, cost=1.0)
    loss = g.add("loss", [c], 1, cost=1.0, is_output=True)
    g.backward()
    t = g.add("t", [loss], kind=Kind.TUPLE, temp=70, cost=1.0)
    x = g.add("t.x", [t], 40, cost=0.0)
    g.add("t.unread", [t], 1000, cost=0.0)
    y = g.add("y", [x, c, b], 20, cost=1.0)
    g.add("z", [y, a], 10, cost=1.0, is_output=True)
    return g.problem("backward_tuples")


def test_backward_tuples_and_unread_tensors():
    problem = backward_tuples()
    meter = PeakMeter(problem)
    nf = problem.num_forward
    for chosen in ([], [1], [2], [0, 1, 2], [1, 2]):
        recomputed = meter.drop_unneeded(chosen)
        schedule = make_schedule(problem, recomputed)
        assert meter.peak(recomputed) == schedule.peak, chosen
        # Recomputations between the tuple op and its tensors: the unread one is held at the
        # first of them only.
        early = make_schedule(problem, recomputed, recompute_at={v: nf + 1 for v in recomputed})
        assert meter.peak(recomputed, early.recompute_at) == early.peak, chosen


def test_on_a_transformer():
    problem = transformer(layers=3, seq=64, d_model=64, heads=2, batch=2)
    meter = PeakMeter(problem)
    candidates = recomputable(problem)
    for step in (1, 2, 3, 5):
        recomputed = meter.drop_unneeded(candidates[::step])
        assert meter.peak(recomputed) == make_schedule(problem, recomputed).peak
    assert all(tuple_of(problem, v) is None or tuple_of(problem, v) in recomputed
               for v in recomputed)
