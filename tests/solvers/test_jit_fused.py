"""The just-in-time model's fused copies (remat.solvers.cpsat.jit_fused) against the simulator:
for every decision of small problems with free values (`Problem.fused_recomputations`), hand
made and random, the model's least peak with the decision fixed is the simulated peak, and a
schedule's hint is a complete solution."""
import random
from itertools import combinations

from ortools.sat.python import cp_model

from remat.solvers import Op, Phase, Problem, SolverOptions, make_schedule, simulate
from remat.solvers.timeline.simulate import copies_of
from remat.solvers.cpsat.jit_model import JitModel
from remat.solvers.cpsat.units import Units
from tests.solvers.test_free_recompute import relu_and_mask, relu_blocks, swiglu
from tests.solvers.test_model_hints import accepted
from tests.synthetic.problems import random_problem, with_free_values

OPTIONS = SolverOptions(cost_resolution=1e-9, workers=1, time_limit=10)
F, B = Phase.FORWARD, Phase.BACKWARD


def model_peak(problem, recomputed: set[int]) -> int:
    """The model's least peak with `recomputed` as the decision, in bytes."""
    units = Units.of(problem, OPTIONS)
    model = JitModel(problem, units)
    for v, x in model.rec.items():
        model.model.Add(x == int(v in recomputed))
    model.model.Minimize(model.peak)
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1
    assert solver.Solve(model.model) == cp_model.OPTIMAL
    return solver.Value(model.peak) * units.byte


def decisions(problem):
    """Every subset of the recomputable forward values that make_schedule accepts."""
    may = sorted(JitModel(problem, Units.of(problem, OPTIONS)).rec)
    seen = set()
    for n in range(len(may) + 1):
        for chosen in combinations(may, n):
            try:
                schedule = make_schedule(problem, set(chosen), budget=None)
            except ValueError:
                continue
            recomputed = frozenset(schedule.recomputed)  # a getitem's tuple op joins it
            if recomputed not in seen:
                seen.add(recomputed)
                yield set(recomputed), schedule


def test_a_mask_recomputed_holds_the_relu_output_to_its_reader():
    problem = relu_and_mask()
    mask = problem.index("mask")
    # By hand (test_free_recompute): 914 bytes saving the mask, 1,214 recomputing it, where
    # the ReLU output is held to the mask's reader; counting the copy instead said 914.
    assert model_peak(problem, set()) == 914
    assert model_peak(problem, {mask}) == 1214
    assert JitModel(problem, Units.of(problem, OPTIONS)).fusion.targets.keys() == {mask}


def test_every_decision_peaks_as_simulated():
    for problem in (relu_and_mask(), swiglu(), relu_blocks([1, 3, 2])):
        tried = 0
        for recomputed, schedule in decisions(problem):
            assert model_peak(problem, recomputed) == schedule.peak, (problem.name, recomputed)
            tried += 1
        assert tried > 4


def test_a_schedule_is_a_complete_hint():
    for problem in (relu_and_mask(), swiglu(), relu_blocks([1, 3, 2])):
        for _, schedule in decisions(problem):
            units = Units.of(problem, OPTIONS)
            model = JitModel(problem, units)
            model.hint(schedule)
            accepted(model, schedule, units)


def chain() -> Problem:
    """A ReLU's output cast to bytes (a free value) and a mask taken from that (free too),
    the mask read by one backward op: recomputed together, Inductor computes both inside that
    op from the ReLU output, held to it (holding the cast's 100 bytes instead undercounts)."""
    ops = (
        Op("relu", F, (), 400), Op("cast", F, (0,), 100), Op("mask", F, (1,), 100),
        Op("conv2", F, (0,), 40), Op("loss", F, (3,), 4, is_output=True),
        Op("g_relu", B, (4, 0), 400), Op("g_weight", B, (5,), 400),
        # scratch at the mask's reader puts the peak there, where the chain holds the ReLU
        Op("g_conv", B, (5, 2), 10, temp=500), Op("g_in", B, (7, 6), 10, is_output=True),
    )
    return Problem(ops, source={"free_recompute": {"cast": 1.0, "mask": 1.0}})


def test_a_fused_chain_holds_its_first_input():
    problem = chain()
    recomputed = {problem.index("cast"), problem.index("mask")}
    schedule = make_schedule(problem, recomputed, budget=None)
    # Both fused into g_conv: the ReLU output is held to it (the chain's copies hold nothing).
    assert schedule.peak == simulate(problem, schedule).peak == 1714
    assert model_peak(problem, recomputed) == schedule.peak
    for recomputed, schedule in decisions(problem):
        assert model_peak(problem, recomputed) == schedule.peak, recomputed


def test_every_decision_of_random_problems_peaks_as_simulated():
    """Random steps with about half their forward values fusable: chains of them, values
    read only by recomputations, by several steps, by a recomputed reader fused elsewhere.
    Every decision's model peak is the simulated one, the model says it is exact, and
    schedules hint it completely."""
    checked = fused = 0
    for seed in range(200):
        rng = random.Random(seed)
        problem = with_free_values(random_problem(seed, max_forward=rng.randint(3, 10),
                                                  max_backward=rng.randint(1, 5)), rng, 0.6)
        if not problem.fused_recomputations:
            continue
        units = Units.of(problem, OPTIONS)
        assert JitModel(problem, units).exact, seed
        for n, (recomputed, schedule) in enumerate(decisions(problem)):
            if n == 64:
                break
            assert model_peak(problem, recomputed) == schedule.peak, (seed, recomputed)
            if n < 8:
                model = JitModel(problem, units)
                model.hint(schedule)
                accepted(model, schedule, units)
            fused += any(c.fused for cs in copies_of(problem, schedule).values() for c in cs)
            checked += 1
    assert checked > 400 and fused > 150, (checked, fused)
