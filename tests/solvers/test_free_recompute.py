"""Values a compiled step recomputes for free: their copies in the simulator
(remat.solvers.timeline.simulate: no bytes, read through their inputs) and the saved ones
recomputed after the solve (remat.solvers.timeline.free_recompute). The problem: a ReLU, its
mask (the free value, computed inside its one backward reader from the ReLU output) and a
convolution reading the ReLU output, whose backward keeps the output saved anyway."""
import pytest

from remat.solvers import Op, Phase, Problem, SolverOptions, make_schedule, simulate, solve
from remat.solvers.timeline.free_recompute import take_free_recomputations
from remat.solvers.timeline.simulate import copies_of

F, B = Phase.FORWARD, Phase.BACKWARD


def relu_and_mask(free_cost: float = 0.0, named: bool = True) -> Problem:
    ops = (
        Op("conv", F, (), 400, cost=1.0, flops=10),
        Op("relu", F, (0,), 400, cost=1.0),
        Op("mask", F, (1,), 100, cost=free_cost),
        Op("conv2", F, (1,), 40, cost=1.0, flops=10),
        Op("loss", F, (3,), 4, is_output=True),
        # the second convolution's backward reads the ReLU output (its weight's gradient too);
        # the ReLU's backward reads the mask
        Op("g_relu", B, (4, 1), 400, cost=1.0, flops=20),
        Op("g_weight", B, (5,), 400, cost=1.0, flops=20),
        Op("g_conv", B, (5, 2), 10, cost=1.0),
        Op("g_in", B, (7, 6), 10, cost=1.0, flops=20, is_output=True),
    )
    source = {"free_recompute": {"mask": 1.0}} if named else {}
    return Problem(ops, source=source)


def index(problem: Problem, name: str) -> int:
    return [op.name for op in problem.ops].index(name)


def test_the_named_values_at_no_cost_are_free():
    assert relu_and_mask().fused_recomputations == {index(relu_and_mask(), "mask")}
    assert not relu_and_mask(named=False).fused_recomputations
    # Named, but costing something in this objective (a FLOPs cost): not free.
    assert not relu_and_mask(free_cost=0.5).fused_recomputations


def test_a_saved_mask_whose_relu_is_saved_is_recomputed_before_its_reader():
    problem = relu_and_mask()
    mask, relu = index(problem, "mask"), index(problem, "relu")
    saving = make_schedule(problem, (), budget=None)
    assert {mask, relu} <= saving.saved
    taken = take_free_recomputations(problem, saving, budget=10**6)
    assert taken.recomputed == {mask} and taken.saved == saving.saved - {mask}
    assert taken.recompute_at[mask] == index(problem, "g_conv")
    assert taken.cost == saving.cost and taken.info["free_recomputations"] == 1
    assert taken.peak == simulate(problem, taken).peak <= 10**6


def test_none_is_taken_above_the_budget():
    problem = relu_and_mask()
    saving = make_schedule(problem, (), budget=None)
    recomputing = make_schedule(problem, {index(problem, "mask")}, budget=None)
    # The ReLU output, held past the weight's gradient to the mask's reader (which computes
    # the mask from it: the recomputed mask holds no bytes), outweighs the mask there: the
    # peak rises (by hand: 914 bytes saving; 1,214 recomputing, at the mask's reader).
    assert (saving.peak, recomputing.peak) == (914, 1214)
    steps = simulate(problem, recomputing).steps
    assert steps[-2].op == problem.index("g_conv") and steps[-2].live == 1214
    assert take_free_recomputations(problem, saving, saving.peak) is saving
    assert take_free_recomputations(problem, saving, recomputing.peak).peak == recomputing.peak


def test_a_mask_whose_relu_is_recomputed_stays_saved():
    problem = relu_and_mask()
    schedule = make_schedule(problem, {index(problem, "relu")}, budget=None)
    assert index(problem, "mask") in schedule.saved
    assert take_free_recomputations(problem, schedule, 10**6) is schedule


@pytest.mark.parametrize("objective", ["time", "flops"])
def test_every_strategy_gets_them_through_solve(objective):
    problem = relu_and_mask()
    options = SolverOptions(objective=objective, time_limit=30)
    for strategy in ("save_all", "optimal"):
        schedule = solve(problem, 10**6, strategy, options)
        assert index(problem, "mask") in schedule.recomputed, strategy
        assert schedule.recompute_flops == 0 and schedule.cost == 0


def swiglu(named: bool = True) -> Problem:
    """A SiLU (the free value) read by its product with `up` in the forward and by `up`'s
    gradient in the backward; the product feeds a projection."""
    ops = (
        Op("gate", F, (), 400), Op("silu", F, (0,), 400), Op("up", F, (), 400),
        Op("prod", F, (1, 2), 400), Op("down", F, (3,), 40), Op("loss", F, (4,), 4, is_output=True),
        Op("g_prod", B, (5,), 400), Op("g_weight", B, (5, 3), 40, is_output=True),
        Op("g_up", B, (6, 1), 400), Op("g_gate", B, (6, 2, 0), 400),
        Op("g_in", B, (8, 9), 400, is_output=True),
    )
    return Problem(ops, source={"free_recompute": {"silu": 1.0}} if named else {})


@pytest.mark.parametrize("also_prod", [False, True])
def test_a_fused_copy_serves_one_op_else_it_is_a_buffer(also_prod):
    problem, plain = swiglu(), swiglu(named=False)
    recomputed = {problem.index("silu")} | ({problem.index("prod")} if also_prod else set())
    schedule = make_schedule(problem, recomputed, budget=None)
    silu = copies_of(problem, schedule)[problem.index("silu")]
    # Serving the product's recomputation and up's gradient, Inductor would compute the SiLU
    # once for both kernels and run them together: a buffer, counted as the plain problem does.
    assert silu[-1].fused is not also_prod
    fused, counted = simulate(problem, schedule), simulate(plain, schedule)
    if also_prod:
        assert fused.lives == counted.lives
    else:  # 400 bytes fewer while the copy would have lived (its recomputation to g_up)
        assert [c - f for f, c in zip(fused.lives, counted.lives)] == \
            [0] * 6 + [0, 0, 400, 400, 0, 0]


def relu_blocks(scales: list[int]) -> Problem:
    """`relu_and_mask`'s block once per scale (its bytes times the scale), all read by one
    loss; the backward runs the blocks in reverse."""
    ops, conv2s, free = [], [], {}
    for k, s in enumerate(scales):
        at = len(ops)
        ops += [Op(f"conv{k}", F, (), 400 * s), Op(f"relu{k}", F, (at,), 400 * s),
                Op(f"mask{k}", F, (at + 1,), 100 * s), Op(f"conv2_{k}", F, (at + 1,), 40 * s)]
        conv2s.append(at + 3)
        free[f"mask{k}"] = 1.0
    loss = len(ops)
    ops.append(Op("loss", F, tuple(conv2s), 4, is_output=True))
    for k in reversed(range(len(scales))):
        s, at, g = scales[k], 4 * k, len(ops)
        ops += [Op(f"g_relu{k}", B, (loss, at + 1), 400 * s),
                Op(f"g_weight{k}", B, (g,), 400 * s),
                Op(f"g_conv{k}", B, (g, at + 2), 10 * s),
                Op(f"g_in{k}", B, (g + 2, g + 1), 10 * s, is_output=True)]
    return Problem(tuple(ops), source={"free_recompute": free})


def test_halves_take_the_most_masks_that_fit():
    """Against every subset of the masks: the pass takes as many as the best subset that fits
    (here recomputing a block's mask raises the peak at that block's backward only, so a mask
    left saved could not be taken beside the others)."""
    from itertools import combinations

    problem = relu_blocks([3, 1, 4, 1, 5, 9])
    masks = sorted(problem.fused_recomputations)
    saving = make_schedule(problem, (), budget=None)
    budget = saving.peak  # the last block's mask, recomputed, raises the peak above it
    fitting = max(len(c) for n in range(len(masks) + 1) for c in combinations(masks, n)
                  if make_schedule(problem, set(c), budget=None).peak <= budget)
    assert 0 < fitting < len(masks)
    taken = take_free_recomputations(problem, saving, budget)
    assert taken.peak <= budget
    assert len(taken.recomputed) == fitting


def test_halving_stops_at_groups(monkeypatch):
    """Where no mask fits (a budget of 0 bytes), the pass halves down to groups of
    candidates / MAX_GROUPS and simulates each group once: fewer schedules than one a
    candidate."""
    from remat.solvers.timeline import free_recompute

    problem = relu_blocks([1] * (4 * free_recompute.MAX_GROUPS))
    saving = make_schedule(problem, (), budget=None)
    made = []
    real = free_recompute._recomputing
    monkeypatch.setattr(free_recompute, "_recomputing",
                        lambda *args: made.append(1) or real(*args))
    assert take_free_recomputations(problem, saving, 0) is saving
    assert len(made) == 2 * free_recompute.MAX_GROUPS - 1 < len(problem.fused_recomputations)
