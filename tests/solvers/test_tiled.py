"""The tiled strategy and the repeated blocks it tiles: families hold identical blocks only,
tiling maps a block's plan onto the same ops of every block, what it returns fits by
`simulate`, it meets brute force on tiny stacks of identical blocks and is never worse than
checkpointing every block where that fits."""
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from remat.errors import BudgetError
from remat.solvers import Problem, SolverOptions, Status, Strategy, make_schedule, simulate, solve
from remat.solvers.core.blocks import families, subproblem
from tests.synthetic.problems import Builder, transformer, unet
from remat.solvers.cpsat.tiled import Tiler

OPTIONS = SolverOptions(time_limit=20, workers=2, free_positions=False)
ROOT = str(Path(__file__).resolve().parents[2])


def small_transformer(layers: int = 4, dropout: bool = True) -> Problem:
    return transformer(layers=layers, seq=64, d_model=64, heads=2, batch=2, dropout=dropout)


def stack(blocks: int) -> Problem:
    """Identical blocks of an up-projection and an activation (big, cheap), a down-projection
    (small, dear) and a residual, between an embedding and a loss that belong to no block."""
    g = Builder()
    x = g.add("embed", [], 10, cost=1.0, module="embed")
    kept = []
    for i in range(blocks):
        m = f"blocks.{i}"
        up = g.add(f"{m}.up", [x], 40, cost=1.0, module=f"{m}.up")
        act = g.add(f"{m}.act", [up], 40, cost=1.0, module=f"{m}.act")
        down = g.add(f"{m}.down", [act], 10, cost=6.0, module=f"{m}.down")
        kept.append((x, up, act))
        x = g.add(f"{m}.res", [x, down], 10, cost=0.5, module=m)
    loss = g.add("loss", [x], 1, cost=1.0, is_output=True, module="head")
    g.backward()
    grad = g.add("grad.loss", [loss], 10, cost=1.0, module="head")
    for i in reversed(range(blocks)):
        m = f"blocks.{i}"
        x_in, up, act = kept[i]
        g.add(f"{m}.down.wgrad", [grad, act], 5, cost=2.0, module=f"{m}.down", is_output=True)
        d_act = g.add(f"{m}.down.dgrad", [grad], 40, cost=2.0, module=f"{m}.down")
        d_up = g.add(f"{m}.act.bwd", [d_act, up], 40, cost=1.0, module=f"{m}.act")
        g.add(f"{m}.up.wgrad", [d_up, x_in], 5, cost=2.0, module=f"{m}.up", is_output=True)
        d_x = g.add(f"{m}.up.dgrad", [d_up], 10, cost=2.0, module=f"{m}.up")
        grad = g.add(f"{m}.res.bwd", [d_x, grad], 10, cost=0.5, module=m)
    return g.problem(f"stack{blocks}")


def suffix(problem: Problem, op: int) -> str:
    """An op's name without its block ("layers.3.attn.q" -> "attn.q")."""
    return problem.ops[op].name.split(".", 2)[2] if "." in problem.ops[op].name else ""


def test_a_family_holds_every_identical_block_and_tiles_position_by_position():
    problem = small_transformer(layers=4)
    [family] = families(problem)
    assert family.names == ("layers.0", "layers.1", "layers.2", "layers.3")
    reference = family.members[0]
    for k, members in enumerate(family.members):
        assert len(members) == len(reference)
        assert all(problem.ops[op].name.startswith(f"layers.{k}.") or
                   problem.ops[op].name == f"layers.{k}" for op in members)
        assert [suffix(problem, op) for op in members] == [suffix(problem, op) for op in reference]
    positions = family.positions(2, [family.members[2][5], family.members[2][9]])
    assert positions == {5, 9}
    tiled = family.tile(1, positions)
    assert sorted(problem.ops[op].name for op in tiled) == sorted(
        problem.ops[op].name.replace("layers.2.", "layers.1.")
        for op in (family.members[2][5], family.members[2][9]))


def test_blocks_that_differ_are_no_family():
    assert families(unet(depth=3, channels=4, resolution=16, batch=1)) == []
    problem = small_transformer(layers=4)
    odd = problem.index("layers.2.mlp.fc1")
    ops = list(problem.ops)
    ops[odd] = replace(ops[odd], flops=ops[odd].flops * 2)  # one op of one block differs
    [family] = families(Problem(tuple(ops), name="odd"))
    assert family.names == ("layers.0", "layers.1", "layers.3")


def test_the_subproblem_keeps_what_leaves_the_block_and_stands_in_for_what_enters():
    problem = small_transformer(layers=4)
    [family] = families(problem)
    sub = subproblem(problem, family.members[2], hold=1234)
    ops = sub.problem.ops
    names = [op.name for op in ops]
    # The block's input and the gradient from the block above are stand-ins.
    assert "boundary.layers.1.res2" in names and "boundary.layers.3.res1.bwd" in names
    assert ops[names.index("boundary.hold")].temp == 1234
    # The block's output, which the next block reads, is kept; its gradient is handed on.
    assert ops[names.index("layers.2.res2")].is_output
    assert ops[names.index("layers.2.res1.bwd")].is_output
    # Every other sub-op is the step's op of the same name.
    for s, op in enumerate(sub.ops):
        assert (op is None) == names[s].startswith("boundary.")
        if op is not None:
            assert problem.ops[op].name == names[s]


@pytest.mark.parametrize("dropout", [True, False])
def test_what_it_returns_fits_by_the_simulator(dropout):
    problem = small_transformer(layers=4, dropout=dropout)
    save_all = make_schedule(problem, []).peak
    tiler = Tiler(problem, OPTIONS)
    fitted = 0
    for share in (0.3, 0.45, 0.5, 0.55, 0.6, 0.7, 0.8, 0.9, 1.0):
        budget = int(share * save_all)
        try:
            schedule = tiler.fit(budget)
        except BudgetError as error:
            assert error.smallest > budget
            assert tiler.fit(error.smallest).peak <= error.smallest
            continue
        fitted += 1
        assert schedule.peak == simulate(problem, schedule).peak <= budget
        assert schedule.status is Status.HEURISTIC and schedule.strategy == "tiled"
    assert fitted >= 5


@pytest.mark.parametrize("blocks", [2, 3])
def test_equals_brute_force_on_tiny_stacks(blocks):
    """Stacks of identical blocks small enough to enumerate: at every budget from the least
    peak to saving everything, the tiled plan costs what the optimum costs."""
    problem = stack(blocks)
    save_all = make_schedule(problem, []).peak
    tiler = Tiler(problem, OPTIONS)
    with pytest.raises(BudgetError) as least:
        solve(problem, 0, Strategy.BRUTE_FORCE, OPTIONS)
    with pytest.raises(BudgetError):
        tiler.fit(least.value.smallest - 1)
    for step in range(6):
        budget = least.value.smallest + (save_all - least.value.smallest) * step // 5
        oracle = solve(problem, budget, Strategy.BRUTE_FORCE, OPTIONS)
        assert tiler.fit(budget).cost == pytest.approx(oracle.cost), budget


def test_never_worse_than_checkpointing_every_block():
    problem = small_transformer(layers=6)
    save_all = make_schedule(problem, []).peak
    tiler = Tiler(problem, OPTIONS)
    compared = 0
    for share in (0.45, 0.5, 0.55, 0.6, 0.7, 0.8, 0.9):
        budget = int(share * save_all)
        try:
            blocks = solve(problem, budget, Strategy.CHECKPOINT_BLOCKS)
        except BudgetError:
            continue
        assert tiler.fit(budget).cost <= blocks.cost
        compared += 1
    assert compared >= 3


def test_without_repeated_blocks_it_saves_everything_or_says_why_not():
    problem = unet(depth=3, channels=4, resolution=16, batch=1)
    save_all = make_schedule(problem, []).peak
    assert solve(problem, save_all, Strategy.TILED, OPTIONS).recomputed == frozenset()
    with pytest.raises(BudgetError, match="no repeated blocks") as error:
        solve(problem, save_all - 1, Strategy.TILED, OPTIONS)
    assert error.value.smallest == save_all


def test_as_a_hint_the_exact_solver_starts_from_it():
    problem = small_transformer(layers=6)
    budget = int(0.6 * make_schedule(problem, []).peak)
    hint = solve(problem, budget, Strategy.TILED, OPTIONS)
    best = solve(problem, budget, Strategy.OPTIMAL,
                 SolverOptions(time_limit=2, workers=2, free_positions=False, hint=hint))
    assert best.peak <= budget
    assert best.cost <= hint.cost + 1e-12


def test_the_new_solver_modules_never_import_torch():
    code = ("import sys; sys.modules['torch'] = None\n"
            "import remat.solvers.core.blocks, remat.solvers.timeline.peak_meter, remat.solvers.cpsat.tiled\n"
            "from remat.solvers import Strategy, solve\n"
            "from tests.synthetic.problems import transformer\n"
            "problem = transformer(layers=2, seq=32, d_model=32, heads=2, batch=1)\n"
            "assert solve(problem, 10 ** 12, Strategy.TILED).cost == 0\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT,
                   env={**os.environ, "PYTHONPATH": ROOT})
