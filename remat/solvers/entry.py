"""The solver's two entries, one per execution mode: `solve` (the compiled mode: every
strategy by name; it checks the budget, solves under the options' objective and refuses a
schedule that does not fit) and `solve_eager` (the eager mode: one selective-checkpoint policy
per block, planned against the eager timeline)."""
from __future__ import annotations

import logging
import time
from dataclasses import replace
from types import MappingProxyType

from remat.errors import BudgetError, SolverError
from remat.solvers.baselines.brute_force import brute_force
from remat.solvers.baselines.standard import BY_STRATEGY
from remat.solvers.core.collector import frozen_heap
from remat.solvers.core.deadline import Deadline
from remat.solvers.core.objective import Objective, with_objective
from remat.solvers.core.options import SolverOptions, sized_and_stated
from remat.solvers.core.problem import Problem
from remat.solvers.core.schedule import Schedule
from remat.solvers.core.strategy import Strategy, StrategyFn
from remat.solvers.cpsat.driver import optimal
from remat.solvers.cpsat.tiled import tiled
from remat.solvers.eager.heuristic import cheapest_prefix, plan_eager, with_offloads
from remat.solvers.eager.search import optimal_eager
from remat.solvers.timeline.eager import eager_schedule
from remat.solvers.timeline.eager_blocks import EagerBlocks
from remat.solvers.timeline.evaluate import check_host_memory, evaluate
from remat.solvers.timeline.free_recompute import take_free_recomputations

log = logging.getLogger(__name__)

# Every strategy by name. One table, written out: a new strategy joins by a row here.
STRATEGIES: MappingProxyType[Strategy, StrategyFn] = MappingProxyType({
    **BY_STRATEGY, Strategy.OPTIMAL: optimal, Strategy.BRUTE_FORCE: brute_force,
    Strategy.TILED: tiled})
# The strategies that run under `SolverOptions.time_limit` and `relative_gap`.
LIMITED = {STRATEGIES[Strategy.OPTIMAL], STRATEGIES[Strategy.TILED]}

# The eager solve's shares of its time limit: the compiled plan that seeds the heuristic, and
# the heuristic (whose plan hints the exact eager search, which has the rest). T5, 274
# cacheable ops: the exact search proved halfway budgets within 1.3 % in 8 s, and stayed at
# 54 % with the 6 s that shares of 0.25 and 0.15 left it.
COMPILED_SEED_SHARE = 0.1
HEURISTIC_SHARE = 0.15
# Above this many ops the compiled seed is not tried: the compiled model takes longer to build
# than its share (Phi-3-mini's 6,762 ops beside two busy processes: "no time left to build the
# model" after its 1.7 s, a warning and per-block checkpointing's policy), and the exact
# search's slot bound gets there from the heuristic's policy alone (Phi-3-mini, Mistral-7B,
# Llama-3-8B: the same plans and gaps without it, 1.3 to 2 s sooner;
# `benchmarks/real_sizes.py --modes eager`).
COMPILED_SEED_MAX_OPS = 2000
# With a host link: the policy planned again with block inputs kept in host memory, at the end.
OFFLOAD_SHARE = 0.15

__all__ = ["STRATEGIES", "Strategy", "StrategyFn", "solve", "solve_eager"]


@frozen_heap()
def solve(problem: Problem, budget: int, strategy: Strategy | str = Strategy.OPTIMAL,
          options: SolverOptions | None = None) -> Schedule:
    """The schedule that `strategy` picks for `problem` whose simulated activation peak is at
    most `budget` bytes. Raises BudgetError when the strategy cannot fit the budget and
    SolverError when it stops with no schedule."""
    try:
        fn = STRATEGIES[Strategy(strategy)]
    except ValueError:
        known = ", ".join(s.value for s in Strategy)
        raise ValueError(f"unknown strategy {strategy!r}; choose one of: {known}") from None
    if not isinstance(budget, int) or budget < 0:
        raise ValueError(f"budget must be a non-negative int of bytes, not {budget!r}")
    options = options or SolverOptions()
    # Limits left to None chosen by size, counting the call's time before the solve.
    options, stated = sized_and_stated(options, len(problem))
    start = time.perf_counter()
    costed = with_objective(problem, options.objective)
    if costed is problem:
        schedule = take_free_recomputations(problem, fn(problem, budget, options), budget)
    else:
        if options.hint is not None:
            options = replace(options, hint=evaluate(costed, options.hint))
        try:
            schedule = take_free_recomputations(costed, fn(costed, budget, options), budget)
            schedule = _in_problem_units(problem, schedule, options.objective)
        except BudgetError as e:
            if e.schedule is not None:
                e.schedule = _in_problem_units(problem, e.schedule, options.objective)
            raise
    if schedule.peak > budget:  # a solver bug: never hand the caller a plan that does not fit
        raise SolverError(
            f"{schedule.strategy}: returned a schedule whose simulated peak {schedule.peak:,} "
            f"exceeds the budget {budget:,}; this is a bug in the strategy: please report it "
            "with the problem (remat.solvers.core.problem_file.dumps) and the budget")
    check_host_memory(problem, schedule)  # offloads within the host's memory, likewise
    if not schedule.solve_time:
        schedule = replace(schedule, solve_time=time.perf_counter() - start)
    if fn in LIMITED:  # the report states the limits the call ran under, and who chose them
        schedule = replace(schedule, info=MappingProxyType({**schedule.info, **stated}))
    return schedule


def _in_problem_units(problem: Problem, schedule: Schedule, objective: str) -> Schedule:
    """A schedule solved under another objective, costed in `problem`'s seconds. Its bound is
    scaled to keep the objective's gap: what is proven is proven of the objective's cost."""
    bound = None
    if schedule.bound is not None and schedule.cost > 0:
        bound = schedule.bound / schedule.cost
    evaluated = evaluate(problem, schedule, info={
        **schedule.info, "objective": Objective.of(objective).value,
        "objective_cost": schedule.cost, "objective_bound": schedule.bound})
    if bound is not None:
        evaluated = replace(evaluated, bound=bound * evaluated.cost)
    return evaluated


@frozen_heap()
def solve_eager(problem: Problem, blocks: EagerBlocks, budget: int,
                strategy: Strategy | str = Strategy.OPTIMAL,
                options: SolverOptions | None = None) -> Schedule:
    """The eager mode's plan: which ops each block's selective-checkpoint policy caches (and,
    with a host link, which block inputs go to host), priced by the eager timeline, with an
    activation peak of at most `budget` bytes. One deadline for the whole solve: the compiled
    mode's plan as a seed, the heuristic, then for `optimal` the exact search hinted by the
    heuristic; any other strategy keeps the heuristic's plan. Per-block checkpointing (every
    block checkpointed, caching nothing) is the answer where it fits and the time allowed
    nothing better (HEURISTIC, why in info["last_resort"]). Raises BudgetError when nothing
    fits, its smallest budget proven or labelled found (`BudgetError.proven`)."""
    strategy = Strategy(strategy)
    # Limits left to None chosen by the eager problem's size: the solve's own time.
    options, stated = sized_and_stated(options or SolverOptions(), len(problem))
    deadline = Deadline(options.time_limit, clock=options.clock or time.perf_counter)
    seeds: list[frozenset[int]] = [frozenset(), blocks.cacheable]
    seed_time = (deadline.share(COMPILED_SEED_SHARE)  # 0: no time left, no seed
                 if len(problem) <= COMPILED_SEED_MAX_OPS else 0.0)
    try:
        # Checkpoint recomputes each value at most once, in the backward: the single model's
        # space is the one this seed is for.
        if seed_time > 0:
            single = replace(options, model="single", time_limit=seed_time)
            seeds.insert(0, solve(problem, budget, strategy, single).saved)
    except (BudgetError, SolverError) as e:
        log.info("eager: no compiled-mode plan to start from (%s); seeding from baselines", e)
    # The eager planner weighs ops by their cost under the objective (seconds, or FLOPs);
    # the schedule it returns is then costed in seconds like every other.
    costed = with_objective(problem, options.objective)
    # The heuristic's share of the limit, its first seed (a few evaluations) included.
    heuristic_time = deadline.within(deadline.share(HEURISTIC_SHARE))
    seeds.insert(0, cheapest_prefix(costed, blocks, budget, heuristic_time))
    # With a host link, the last share of the limit plans the block inputs kept in host
    # memory, on top of the policy found before it (the exact search plans no offload).
    offload_time = deadline.share(OFFLOAD_SHARE) if problem.host_bandwidth else 0.0
    solving = deadline.until(deadline.end - offload_time) if offload_time else deadline
    failed = None
    try:
        heuristic = plan_eager(costed, blocks, budget, seeds, heuristic_time)
    except BudgetError as e:
        if strategy is not Strategy.OPTIMAL and not offload_time:
            raise
        heuristic, failed = None, e
    try:
        if strategy is Strategy.OPTIMAL:  # exact over the eager timeline, from the heuristic
            # Its last resort (per-block checkpointing, no time to repair) is the exact
            # search's too, which says so where the time allows it nothing better.
            resort = heuristic is None or "last_resort" in heuristic.info
            schedule = optimal_eager(problem, blocks, budget, options,
                                     hint=None if resort else heuristic.info["cached"],
                                     deadline=solving)
        elif heuristic is None:
            raise failed
        else:
            schedule = eager_schedule(problem, blocks, heuristic.info["cached"], budget=budget)
            if "last_resort" in heuristic.info:  # why, for the report
                schedule = replace(schedule, info=MappingProxyType(
                    {**schedule.info, "last_resort": heuristic.info["last_resort"]}))
    except BudgetError as e:
        if not offload_time:
            raise
        schedule, failed = None, e  # offloading may fit where caching less cannot
    if offload_time:
        schedule = _offloaded(problem, costed, blocks, budget, seeds, schedule,
                              failed if schedule is None else None, deadline)
    # The report states the limits the solve ran under, and who chose them.
    return replace(schedule, info=MappingProxyType({**schedule.info, **stated}))


def _offloaded(problem: Problem, costed: Problem, blocks: EagerBlocks, budget: int, seeds,
               schedule: Schedule | None, failed: BudgetError | None,
               deadline: Deadline) -> Schedule:
    """`schedule` (None: nothing fitted, as `failed` says), or where it costs less or only it
    fits, the policy planned again from its cache with the block inputs whose transfers hide
    kept in host memory (`remat.solvers.eager.heuristic.with_offloads`, weighed under the
    objective like the heuristic: `costed`), as eager_schedule's in seconds (HEURISTIC)."""
    start = None if schedule is None else eager_schedule(costed, blocks,
                                                         schedule.info["cached"], budget=budget)
    found = with_offloads(costed, blocks, budget, seeds, start, deadline)
    if found is None:
        raise failed
    if found is start:
        return schedule
    offloading = eager_schedule(problem, blocks, found.info["cached"],
                                offload=found.info["offload"], budget=budget)
    return replace(offloading, info=MappingProxyType(
        {**offloading.info, "model": "eager heuristic, with offloads"}))
