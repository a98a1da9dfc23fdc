"""The simulator against memory timelines computed by hand, step by step.

Each table lists the live bytes at every step (forward ops, then recomputations and backward
ops), worked out from the execution model (docs/execution-model.md)."""
import pytest

from remat.solvers import Kind, Op, Phase, Problem, Reason, StepKind, make_schedule, simulate

F, B = Phase.FORWARD, Phase.BACKWARD


def chain():
    return Problem((
        Op("a", F, (), 100), Op("b", F, (0,), 200), Op("c", F, (1,), 300),
        Op("loss", F, (2,), 4, is_output=True),
        Op("gc", B, (2,), 300), Op("gb", B, (4, 1), 200), Op("ga", B, (5, 0), 100, is_output=True),
    ))


def diamond():
    return Problem((
        Op("x", F, (), 10), Op("l", F, (0,), 20), Op("r", F, (0,), 30), Op("s", F, (1, 2), 40),
        Op("loss", F, (3,), 1, is_output=True),
        Op("gs", B, (3,), 40), Op("gl", B, (5, 2), 20), Op("gr", B, (5, 1), 30),
        Op("gx", B, (6, 7, 0), 10, is_output=True),
    ))


def unet():
    return Problem((
        Op("e1", F, (), 100), Op("e2", F, (0,), 50), Op("m", F, (1,), 25),
        Op("d2", F, (2, 1), 50), Op("d1", F, (3, 0), 100), Op("loss", F, (4,), 1, is_output=True),
        Op("gd1", B, (4,), 100), Op("gd2", B, (6, 3), 50), Op("gm", B, (7, 2), 25),
        Op("ge2", B, (7, 8, 1), 50), Op("ge1", B, (6, 9, 0), 100, is_output=True),
    ))


def attention_block():
    """Layer norm as a tuple op, softmax+dropout as a random tuple op, a transposed view."""
    return Problem((
        Op("ln", F, (), kind=Kind.TUPLE, temp=36),
        Op("ln_out", F, (0,), 32), Op("ln_rstd", F, (0,), 4),
        Op("qk", F, (1,), 64),
        Op("drop", F, (3,), kind=Kind.TUPLE, temp=80, not_recomputable=Reason.RANDOM),
        Op("p", F, (4,), 64), Op("mask", F, (4,), 16),
        Op("pT", F, (5,), kind=Kind.VIEW),
        Op("y", F, (7, 1), 32), Op("loss", F, (8,), 1, is_output=True),
        Op("gy", B, (9,), 32), Op("gp", B, (10, 1), 64), Op("g_ln_out", B, (10, 7), 32),
        Op("gs", B, (11, 6), 64), Op("gx", B, (13, 12, 1, 2), 32, is_output=True),
    ))


CASES = [
    (chain, [], [100, 300, 600, 604, 904, 804, 404]),
    (chain, ["b", "c"], [100, 300, 600, 404, 304, 604, 904, 804, 404]),
    (diamond, [], [10, 30, 60, 100, 101, 141, 121, 121, 71]),
    (diamond, ["l", "r"], [10, 30, 60, 100, 51, 91, 81, 101, 91, 121, 71]),
    (unet, [], [100, 150, 175, 225, 325, 326, 426, 376, 351, 376, 351]),
    (unet, ["e1"], [100, 150, 175, 225, 325, 226, 326, 276, 251, 276, 251, 351]),
    # ln_rstd and mask exist from the step after their tuple op's, like the tensors before them.
    (attention_block, [], [36, 36, 36, 100, 180, 116, 116, 116, 148, 149,
                           149, 213, 245, 213, 165]),
    (attention_block, ["ln_out"], [36, 36, 36, 100, 180, 116, 116, 116, 148, 117,
                                   117, 153, 149, 213, 245, 213, 165]),
]


@pytest.mark.parametrize("build, recomputed, expected", CASES,
                         ids=[f"{c[0].__name__}-{'+'.join(c[1]) or 'save_all'}" for c in CASES])
def test_timeline_matches_hand_computation(build, recomputed, expected):
    problem = build()
    schedule = make_schedule(problem, [problem.index(n) for n in recomputed])
    timeline = simulate(problem, schedule)
    assert [s.live for s in timeline.steps] == expected
    assert timeline.peak == max(expected)


def test_recompute_steps_come_before_their_first_reader():
    problem = diamond()
    schedule = make_schedule(problem, [1, 2])
    kinds = [(problem.ops[s.op].name, s.kind) for s in simulate(problem, schedule).steps]
    assert kinds[5:10] == [("gs", StepKind.BACKWARD), ("r", StepKind.RECOMPUTE),
                           ("gl", StepKind.BACKWARD), ("l", StepKind.RECOMPUTE),
                           ("gr", StepKind.BACKWARD)]


def test_saved_set_is_what_the_backward_needs_and_is_not_recomputed():
    problem = attention_block()
    names = lambda ids: sorted(problem.ops[i].name for i in ids)  # noqa: E731
    assert names(make_schedule(problem, []).saved) == ["ln_out", "ln_rstd", "loss", "mask", "p"]
    schedule = make_schedule(problem, [problem.index("ln_out")])
    # Recomputing a tensor taken out of a tuple recomputes the tuple op, at the same place.
    assert names(schedule.recomputed) == ["ln", "ln_out"]
    assert schedule.recompute_at[0] == schedule.recompute_at[1] == problem.index("gp")


def test_evaluated_schedule_carries_cost_flops_and_peak():
    problem = Problem((
        Op("a", F, (), 10, cost=1.5, flops=7), Op("b", F, (0,), 10, cost=2.0, flops=11),
        Op("loss", F, (1,), 1, is_output=True), Op("gb", B, (1, 0), 10, is_output=True),
    ))
    evaluated = make_schedule(problem, [1], strategy="hand")
    assert evaluated.strategy == "hand"
    assert (evaluated.cost, evaluated.recompute_flops) == (2.0, 11)
    assert evaluated.peak == simulate(problem, evaluated).peak == 31


@pytest.mark.parametrize("recompute, message", [
    (["p"], r"not recomputable \(inherited\)"),
    (["drop"], r"not recomputable \(random\)"),
    (["pT"], "views are rebuilt"),
    (["loss"], "it is an output"),
    (["y"], "the backward never needs"),
])
def test_impossible_decisions_are_refused_by_name(recompute, message):
    problem = attention_block()
    with pytest.raises(ValueError, match=message):
        make_schedule(problem, [problem.index(n) for n in recompute])


def test_explicit_positions_are_checked():
    problem = diamond()
    ok = make_schedule(problem, [2], recompute_at={2: problem.index("gs")})
    assert simulate(problem, ok).peak == 141  # recomputing early holds r through gs
    with pytest.raises(ValueError, match="after 'gl' needs it"):
        make_schedule(problem, [2], recompute_at={2: problem.index("gr")})
    with pytest.raises(ValueError, match="not a backward op"):
        make_schedule(problem, [2], recompute_at={2: 3})


def test_empty_problem_and_no_backward():
    empty = Problem(())
    assert simulate(empty, make_schedule(empty, [])).peak == 0
    forward_only = Problem((Op("a", F, (), 8), Op("b", F, (0,), 4, is_output=True)))
    schedule = make_schedule(forward_only, [])
    assert schedule.saved == frozenset() and simulate(forward_only, schedule).peak == 12


def test_zero_byte_tensors_cost_nothing():
    problem = Problem((Op("a", F, (), 0), Op("loss", F, (0,), 0, is_output=True),
                       Op("ga", B, (0,), 0, is_output=True)))
    assert simulate(problem, make_schedule(problem, [])).peak == 0


def test_forward_outputs_live_to_the_end_of_the_forward_only():
    """A mutated buffer's new value (BatchNorm's running mean) is handed back when the forward
    returns and dropped: it overlaps the rest of the forward, not the backward."""
    problem = Problem((
        Op("x", F, (), 100),
        Op("stat", F, (0,), 8, forward_output=True),
        Op("y", F, (0,), 50),
        Op("loss", F, (2,), 4, is_output=True),
        Op("gy", B, (3,), 50),
        Op("gx", B, (4, 0), 100, is_output=True),
    ))
    steps = simulate(problem, make_schedule(problem, [])).steps
    live = [s.live for s in steps]
    # x, stat, y, loss: the stat lives through the loss; in the backward it is gone.
    assert live == [100, 108, 158, 162, 154, 254]
