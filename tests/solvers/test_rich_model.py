"""The richer execution model against hand-worked timelines and the single model.

`rich_brute_force` enumerates the richer space (further copies within the forward and the
backward, offload); `brute_force` the single one (one recomputation, in the backward). On hand-made
graphs the richer plan is strictly better, step by step; on random problems it is never worse,
and equal where it uses no further copy.
"""
import dataclasses
import random

import pytest

from remat.errors import BudgetError
from remat.solvers import Op, Phase, Problem, SolverOptions, StepKind, make_schedule, simulate
from remat.solvers.baselines.brute_force import brute_force
from tests.oracles import rich_brute
from tests.oracles.rich_brute import rich_brute_force, rich_smallest_peak
from tests.synthetic.problems import random_problem
from tests.synthetic.cnn import skip_chain_problem, unet_problem

F, B = Phase.FORWARD, Phase.BACKWARD
FREE = SolverOptions()  # brute_force with free positions, as the exact solver searches


def timeline(problem, schedule):
    return [(problem.ops[s.op].name, s.kind.value[0], s.live)
            for s in simulate(problem, schedule).steps]


def skip_in_the_backward():
    """`a` is read early (g1) and late (g3) in the backward, with a big gradient in between."""
    return Problem((
        Op("a", F, (), 10, cost=1.0), Op("y", F, (0,), 5, cost=5.0),
        Op("loss", F, (1,), 1, cost=1.0, is_output=True),
        Op("g1", B, (2, 0), 1), Op("big", B, (3,), 20), Op("g2", B, (4,), 1),
        Op("g3", B, (5, 0, 1), 1, is_output=True),
    ))


def test_a_second_recomputation_beats_anything_single():
    """Budget 32. The single model's best recomputes y (cost 5); recomputing a once cannot help,
    since a lives from its first backward read (g1) to its last (g3), across `big`. The richer
    plan recomputes a before g1 and again before g3 (cost 2), so a is dead while `big` lives.

    | step          | single: y recomputed | rich: a twice, y saved |
    | a             | 10 (a)               | 10                     |
    | y             | 15 (a y)             | 15                     |
    | loss          | 16 (a y loss)        |  6 (y loss: a is dead) |
    | recompute a   |  -                   | 16 (y loss a)          |
    | g1            | 12 (a loss g1)       | 17 (y loss a g1)       |
    | big           | 32 (a loss g1 big)   | 27 (y loss g1 big)     |
    | g2            | 32 (a loss big g2)   | 27 (y loss big g2)     |
    | recompute a/y | 17 (a loss g2 y)     | 17 (y loss g2 a)       |
    | g3            | 18 (+ g3)            | 18 (+ g3)              |
    """
    p = skip_in_the_backward()
    today = brute_force(p, 32, FREE)
    assert (today.cost, today.peak, today.recomputed) == (5.0, 32, {1})
    assert timeline(p, today) == [
        ("a", "f", 10), ("y", "f", 15), ("loss", "f", 16), ("g1", "b", 12), ("big", "b", 32),
        ("g2", "b", 32), ("y", "r", 17), ("g3", "b", 18)]
    rich = rich_brute_force(p, 32)
    assert (rich.cost, rich.peak, rich.recomputed) == (2.0, 27, {0})
    assert dict(rich.recompute_at) == {0: 3} and dict(rich.again) == {0: (6,)}
    assert timeline(p, rich) == [
        ("a", "f", 10), ("y", "f", 15), ("loss", "f", 6), ("a", "r", 16), ("g1", "b", 17),
        ("big", "b", 27), ("g2", "b", 27), ("a", "r", 17), ("g3", "b", 18)]
    with pytest.raises(BudgetError) as error:  # the single model cannot go below 32
        brute_force(p, 27, FREE)
    assert error.value.smallest == 32
    assert rich_smallest_peak(p) == 22  # y recomputed too, after the second copy of a


def skip_in_the_forward():
    """A long skip connection: `a` is read by b and again by e, four ops later, across the big
    `c`. The backward never needs a, so the single model cannot touch it."""
    return Problem((
        Op("a", F, (), 10, cost=1.0), Op("b", F, (0,), 1, cost=1.0),
        Op("c", F, (1,), 20, cost=1.0), Op("d", F, (2,), 1, cost=1.0),
        Op("e", F, (3, 0), 1, cost=1.0), Op("loss", F, (4,), 1, cost=1.0, is_output=True),
        Op("g", B, (5, 3), 1, is_output=True),
    ))


def test_a_forward_recomputation_ends_a_long_skip():
    """Budget 25: the single model's peak is 31 whatever it does; recomputing a just before e
    (cost 1) frees it across c.

    | step        | single (save all) | rich: a again before e |
    | a           | 10 (a)            | 10                     |
    | b           | 11 (a b)          | 11                     |
    | c           | 31 (a b c)        | 21 (b c)               |
    | d           | 31 (a c d)        | 21 (c d)               |
    | recompute a |  -                | 11 (d a)               |
    | e           | 12 (a d e)        | 12 (d a e)             |
    | loss        |  3 (d e loss)     |  3                     |
    | g           |  3 (d loss g)     |  3                     |
    """
    p = skip_in_the_forward()
    with pytest.raises(BudgetError) as error:
        brute_force(p, 25, FREE)
    assert error.value.smallest == 31
    rich = rich_brute_force(p, 25)
    assert (rich.cost, rich.peak, dict(rich.again), rich.recomputed) == (1.0, 21, {0: (4,)},
                                                                         frozenset())
    assert timeline(p, rich) == [
        ("a", "f", 10), ("b", "f", 11), ("c", "f", 21), ("d", "f", 21), ("a", "r", 11),
        ("e", "f", 12), ("loss", "f", 3), ("g", "b", 3)]
    assert timeline(p, make_schedule(p, []))[2:4] == [("c", "f", 31), ("d", "f", 31)]


def budgets(problem):
    high = simulate(problem, make_schedule(problem, [])).peak
    try:
        low = brute_force(problem, 0, FREE).peak
    except BudgetError as error:
        low = error.smallest
    return [low + (high - low) * k // 4 for k in (0, 1, 2)] + [low - 1, int(0.9 * low)]


def outcome(fn, *args, **kwargs):
    try:
        s = fn(*args, **kwargs)
        return (s.cost, s.peak), s
    except BudgetError:
        return None, None


@pytest.mark.parametrize("seed", range(40))
def test_never_worse_than_single_and_equal_without_copies(seed):
    problem = random_problem(seed, max_forward=6, max_backward=6, p_tuple=0.2)
    for budget in budgets(problem):
        single, _ = outcome(brute_force, problem, budget, FREE)
        rich, schedule = outcome(rich_brute_force, problem, budget)
        none, _ = outcome(rich_brute_force, problem, budget, max_copies=0)
        assert none == single  # the same space, searched another way
        if single is None:
            continue
        assert rich is not None and rich <= single
        if not schedule.again:
            assert rich == single
        assert schedule.recomputations == len(schedule.recomputed) + sum(
            map(len, schedule.again.values()))


@pytest.mark.parametrize("seed", range(12))
def test_offload_is_a_third_choice(seed):
    """With a host link, offloading can only help; each offloaded value is saved, loaded back
    before its first backward read, and costed both ways."""
    problem = dataclasses.replace(random_problem(seed, max_forward=6, max_backward=6),
                                  host_bandwidth=random.Random(seed).choice([5.0, 50.0]))
    for budget in budgets(problem)[:3]:
        without, _ = outcome(rich_brute_force, problem, budget, offload=False)
        with_, schedule = outcome(rich_brute_force, problem, budget)
        if without is None:
            continue
        assert with_ <= without
        for v in schedule.offload_at:
            assert v in schedule.saved
        transfer = sum(2 * problem.ops[v].size / problem.host_bandwidth
                       for v in schedule.offload_at)
        assert schedule.transfer_time == pytest.approx(transfer)


def test_rich_search_is_exhaustive_on_a_tiny_problem():
    """Against a plain enumeration of every copy position of one value (written here, apart
    from the search): the two agree on the least cost and peak."""
    p = skip_in_the_backward()
    best = None
    for first in range(3, 7):
        for again in [(), *((q,) for q in range(first + 1, 7)),
                      *((q, r) for q in range(first + 1, 7) for r in range(q + 1, 7))]:
            try:
                s = make_schedule(p, [0], recompute_at={0: first}, again={0: again})
            except ValueError:
                continue
            if s.peak <= 30 and (best is None or (s.cost, s.peak) < best):
                best = (s.cost, s.peak)
    rich = rich_brute_force(p, 30)
    assert (rich.cost, rich.peak) == best == (2.0, 27)


def test_refuses_beyond_its_limits(monkeypatch):
    monkeypatch.setattr(rich_brute, "MAX_SCHEDULES", 3)
    p = unet_problem(1)
    with pytest.raises(ValueError, match="stops at 3 schedules"):
        rich_brute_force(p, int(0.85 * simulate(p, make_schedule(p, [])).peak))
    monkeypatch.setattr(rich_brute, "MAX_SHAPES", 2)
    with pytest.raises(ValueError, match="stops at 2 shapes"):
        rich_brute_force(skip_in_the_backward(), 22)
    with pytest.raises(ValueError, match="host_bandwidth"):
        rich_brute_force(skip_in_the_backward(), 30, offload=True)


@pytest.mark.parametrize("make", [lambda: unet_problem(2, seed=1),
                                  lambda: skip_chain_problem(3, 2, seed=2)])
def test_cnn_generators_read_what_autograd_reads(make):
    """Activations shrink with depth; a conv's ReLU backward reads its output, its weight
    gradient its input, its data gradient neither; a concatenation's backward is views."""
    p = make()
    convs = [i for i in p.forward if p.ops[i].target.startswith("aten.convolution")]
    sizes = [p.ops[i].size for i in convs if p.ops[i].name.startswith(("down", "s"))]
    assert sizes[0] > sizes[-1]
    for v in convs:
        name = p.ops[v].name
        relu_bwd, wgrad = p.index(f"{name}.relu_bwd"), p.index(f"{name}.wgrad")
        assert v in p.ops[relu_bwd].inputs
        assert p.ops[wgrad].is_output and set(p.ops[wgrad].inputs[1:]) == set(p.ops[v].inputs)
        if p.ops[v].inputs:
            assert p.ops[p.index(f"{name}.dgrad")].inputs == (relu_bwd,)
    cat_grads = [op for op in p.ops if ".cat.bwd" in op.name or "skip_cat.bwd" in op.name]
    assert cat_grads and all(op.kind.value == "view" for op in cat_grads)
    assert p.ops[p.index("loss")].is_output


def test_skip_chain_needs_a_second_recomputation():
    """On the generator's smallest VGG-like chain, 90 % of save-all's peak is out of the single
    model's reach and within the richer model's, by recomputing the long skip's source again."""
    p = skip_chain_problem(2, 1)
    budget = int(0.9 * simulate(p, make_schedule(p, [])).peak)
    with pytest.raises(BudgetError):
        brute_force(p, budget, FREE)
    rich = rich_brute_force(p, budget)
    assert rich.peak <= budget and any(p.ops[v].name == "s0.conv0" for v in rich.again)
    assert StepKind.RECOMPUTE in {s.kind for s in simulate(p, rich).steps}
