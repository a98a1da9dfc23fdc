"""The exact solver's offloads against the exhaustive search over the rich space,
which prices every schedule by the transfer timeline (`remat.solvers.timeline.overlap`).

The rich CP-SAT model bounds what the step waits for its transfers from above and holds device
copies at least as long as they live (`remat.solvers.cpsat.rich_offload`), then prices its plan
exactly: its plans fit and cost what they say, never less than the optimum. Where transfers are
comparable to the compute, it finds the optimum; what it cannot see are plans whose device copies
are freed sooner because the compute waits for a load (measured on 40 random steps at a slow
link)."""

import pytest

from remat.errors import BudgetError
from remat.solvers import Problem, SolverOptions, make_schedule, simulate, solve
from remat.solvers.core.deadline import Deadline
from remat.solvers.cpsat.offload_search import improve_by_offload
from tests.oracles.rich_brute import rich_brute_force, rich_smallest_peak
from remat.solvers.timeline.evaluate import price
from tests.synthetic.problems import random_problem, transformer

SEEDS = range(40)


def _step(seed: int, bandwidth: float) -> tuple[Problem, int]:
    """A small random step with a host link, and a budget a fifth of the way from the rich
    space's least peak to saving everything."""
    base = random_problem(seed, max_forward=6, max_backward=5)
    problem = Problem(base.ops, name=base.name, host_bandwidth=bandwidth)
    low = rich_smallest_peak(problem, max_copies=1)
    high = simulate(problem, make_schedule(problem, [])).peak
    return problem, low + (high - low) // 5


@pytest.mark.parametrize("model", ["rich", "auto"])
def test_the_solver_finds_the_exhaustive_optimum_where_transfers_are_like_compute(model):
    """40 fixed random steps at 20 bytes/s (a transfer of 1 to 5 s beside ops of 1 to 10 s):
    the solver's plan fits, costs exactly the timeline's price, and equals the exhaustive
    optimum on every one; some of those optima offload."""
    offloading = 0
    for seed in SEEDS:
        problem, budget = _step(seed, 20.0)
        oracle = rich_brute_force(problem, budget, max_copies=1)
        plan = solve(problem, budget, "optimal",
                     SolverOptions(cost_resolution=1e-9, workers=2, time_limit=20, model=model,
                                   max_copies=1))
        assert plan.peak == simulate(problem, plan).peak <= budget
        assert plan.cost == price(problem, plan)[0]
        assert plan.cost == pytest.approx(oracle.cost, rel=1e-6, abs=1e-9), seed
        offloading += bool(plan.offload_at)
    assert offloading >= 5


def test_the_rich_model_keeps_within_the_host_capacity():
    """On steps whose optimum offloads, a host capacity below what it offloads: the solver's
    plan holds no more in host memory, and still costs what the exhaustive search finds."""
    checked = 0
    for seed in SEEDS:
        problem, budget = _step(seed, 20.0)
        free = rich_brute_force(problem, budget, max_copies=1)
        held = sum(problem.ops[v].size for v in free.offload_at)
        if not held or free.cost == 0:
            continue
        capped = Problem(problem.ops, host_bandwidth=20.0, host_capacity=held - 1)
        try:
            oracle = rich_brute_force(capped, budget, max_copies=1)
        except BudgetError:
            continue
        plan = solve(capped, budget, "optimal",
                     SolverOptions(cost_resolution=1e-9, workers=2, time_limit=20,
                                   model="rich", max_copies=1))
        assert sum(capped.ops[v].size for v in plan.offload_at) <= held - 1
        assert plan.cost == pytest.approx(oracle.cost, rel=1e-6, abs=1e-9), seed
        checked += 1
    assert checked >= 3


def test_the_offload_search_keeps_in_host_memory_what_a_plan_recomputes():
    """On a synthetic transformer over a PCIe-class link, the search turns recomputations
    into offloads whose transfers hide: cheaper, within the budget and the host's capacity,
    priced exactly; without a link it changes nothing."""
    problem = transformer(layers=2, seq=512, d_model=512, heads=8)
    linked = Problem(problem.ops, host_bandwidth=64e9)
    budget = int(0.6 * simulate(linked, make_schedule(linked, [])).peak)
    single = solve(linked, budget, "optimal", SolverOptions(time_limit=10, model="single"))
    assert single.recomputed and not single.offload_at
    assert improve_by_offload(problem, budget, single, deadline=Deadline(30)) \
        is single
    better = improve_by_offload(linked, budget, single, deadline=Deadline(30))
    assert better.offload_at and better.cost < single.cost and better.peak <= budget
    assert better.cost == price(linked, better)[0]
    assert better.info["offload_search"]["from_cost"] == single.cost
    room = min(linked.ops[v].size for v in better.offload_at)
    capped = Problem(problem.ops, host_bandwidth=64e9, host_capacity=room)
    limited = improve_by_offload(capped, budget, single, deadline=Deadline(30))
    assert sum(capped.ops[v].size for v in limited.offload_at) <= room
