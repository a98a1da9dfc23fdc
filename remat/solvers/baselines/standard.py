"""The baselines: small, predictable strategies that the exact solver must never lose to.

Each has the signature of every strategy, `(problem, budget, options) -> Schedule` (the prefix
searches take the exact solver's `deadline` too, and stop at it), places
its recomputations just before their first use (the execution model's default), and raises
BudgetError with its own smallest peak when its schedule does not fit.
"""
from __future__ import annotations

import math
from types import MappingProxyType

from remat.errors import BudgetError
from remat.solvers.core.blocks import block_of
from remat.solvers.core.deadline import Deadline
from remat.solvers.core.options import SolverOptions
from remat.solvers.timeline.peak_meter import PeakMeter
from remat.solvers.core.problem import Problem, tuple_of
from remat.solvers.core.strategy import Strategy, StrategyFn
from remat.solvers.core.schedule import Schedule, Status, drop_unneeded, recomputable
from remat.solvers.timeline.evaluate import make_schedule

__all__ = ["BY_STRATEGY", "block_of", "checkpoint_blocks", "chen_sqrt", "greedy", "save_all",
           "selective"]


def _fitting(problem: Problem, recomputed, budget: int, strategy: Strategy) -> Schedule:
    schedule = make_schedule(problem, drop_unneeded(problem, recomputed), strategy=strategy.value,
                             status=Status.HEURISTIC, budget=budget)
    if schedule.peak > budget:
        raise BudgetError(
            f"{strategy.value}: its schedule peaks at {schedule.peak:,} bytes of activations, "
            f"above the budget of {budget:,}; try the optimal strategy or a larger budget",
            budget=budget, smallest=schedule.peak)
    return schedule


def save_all(problem: Problem, budget: int, options: SolverOptions) -> Schedule:
    """Save every forward value the backward needs; recompute nothing (plain PyTorch)."""
    return _fitting(problem, (), budget, Strategy.SAVE_ALL)


def checkpoint_blocks(problem: Problem, budget: int, options: SolverOptions) -> Schedule:
    """What `torch.utils.checkpoint` around every block does: keep what enters each block from
    outside it, recompute everything inside. Values that may not be recomputed (dropout masks)
    stay saved, as they would with RNG replay they would cost nothing to keep here."""
    blocks = [block_of(op.module) for op in problem.ops]
    recompute = []
    for v in recomputable(problem):
        block = blocks[v]
        if block is None:
            continue
        crosses = any(blocks[r] != block for r in problem.users[v] if r < problem.num_forward)
        if not crosses:
            recompute.append(v)
    return _fitting(problem, recompute, budget, Strategy.CHECKPOINT_BLOCKS)


def chen_sqrt(problem: Problem, budget: int, options: SolverOptions) -> Schedule:
    """Chen et al. (2016): cut the forward into about sqrt(n) segments of equal bytes, keep what
    crosses a segment boundary, recompute the rest."""
    candidates = recomputable(problem)
    if not candidates:
        return _fitting(problem, (), budget, Strategy.CHEN_SQRT)
    segments = max(1, round(math.sqrt(len(candidates))))
    total = sum(problem.ops[v].size for v in candidates)
    segment_of: dict[int, int] = {}
    running = 0
    for v in candidates:
        segment_of[v] = min(segments - 1, running * segments // max(total, 1))
        running += problem.ops[v].size
    recompute = [v for v in candidates
                 if all(segment_of.get(r, -1) == segment_of[v]
                        for r in problem.users[v] if r < problem.num_forward)]
    return _fitting(problem, recompute, budget, Strategy.CHEN_SQRT)


# Prefix lengths greedy and selective try before they bisect: the peak is not monotone in the
# length.
GREEDY_GRID = 32


def unit_cost(problem: Problem, v: int) -> float:
    """What recomputing `v` alone costs: its own cost and, for a tensor taken out of a tuple op
    (fx's getitem, cost zero), the tuple op's, which recomputing it runs again. Ordered by its
    own cost, attention's output (a getitem of `_scaled_dot_product_*_attention`) looks free."""
    t = tuple_of(problem, v)
    return problem.ops[v].cost + (problem.ops[t].cost if t is not None else 0.0)


def does_flops(problem: Problem, v: int) -> bool:
    """Whether recomputing `v` runs an op that does FLOPs (a matmul, a convolution, attention:
    what FLOP counters count), rather than a memory-bound one (pointwise, norms, copies)."""
    t = tuple_of(problem, v)
    return problem.ops[v].flops > 0 or (t is not None and problem.ops[t].flops > 0)


def _cheapest_prefix(problem: Problem, order: list[int], budget: int,
                     strategy: Strategy, deadline: Deadline | None = None) -> Schedule:
    """The cheapest fitting schedule that recomputes a prefix of `order`, as few as fit.

    A longer prefix costs more but does not always peak lower: recomputing everything puts
    every recomputation at the start of the backward, where it peaks as high as saving
    everything. So the search scans prefix lengths on a grid, then bisects below the first that
    fits, and returns the cheapest fitting prefix it evaluated; BudgetError with the least peak
    it saw when none fits. That is O(log n) evaluations of O(n) each (`PeakMeter`); only the
    chosen prefix is built and simulated as a Schedule. OutOfTime when `deadline` passes."""
    meter = PeakMeter(problem)
    evaluated: dict[int, tuple[float, int, set[int]]] = {}  # length: (cost, peak, decision)

    def peak(k: int) -> int:
        if deadline is not None:
            deadline.raise_if_expired(strategy.value)
        if k not in evaluated:
            recomputed = meter.drop_unneeded(order[:k])
            evaluated[k] = (meter.cost(recomputed), meter.peak(recomputed), recomputed)
        return evaluated[k][1]

    grid = sorted({len(order) * i // GREEDY_GRID for i in range(GREEDY_GRID + 1)})
    low, high = 0, None
    for k in grid:
        if peak(k) <= budget:
            high = k
            break
        low = k
    if high is None:
        smallest = min(p for _, p, _ in evaluated.values())
        raise BudgetError(
            f"{strategy.value}: no prefix of its order fits; the least peak it saw is "
            f"{smallest:,} bytes, above the budget of {budget:,}; try the optimal strategy or a "
            "larger budget", budget=budget, smallest=smallest)
    while high - low > 1:
        middle = (low + high) // 2
        if peak(middle) <= budget:
            high = middle
        else:
            low = middle
    _, _, recomputed = min((e for e in evaluated.values() if e[1] <= budget),
                           key=lambda e: e[:2])
    return make_schedule(problem, recomputed, strategy=strategy.value, status=Status.HEURISTIC,
                         budget=budget)


def greedy(problem: Problem, budget: int, options: SolverOptions, *,
           deadline: Deadline | None = None) -> Schedule:
    """Recompute the values that cost the least per byte first, as few as fit
    (`_cheapest_prefix`). A tensor taken out of a tuple op pays for the tuple op (`unit_cost`):
    by its own cost of zero, attention's output would go first, and its recomputation with it."""
    order = sorted(recomputable(problem),
                   key=lambda v: (unit_cost(problem, v) / problem.ops[v].size, v))
    return _cheapest_prefix(problem, order, budget, Strategy.GREEDY, deadline)


def selective(problem: Problem, budget: int, options: SolverOptions, *,
              deadline: Deadline | None = None) -> Schedule:
    """Megatron's selective recomputation (Korthikanti et al. 2022): keep the outputs of the ops
    that do FLOPs (matmuls, attention) and recompute only memory-bound ones (norms,
    activations, rotary embeddings, casts), cheapest per byte first, as few as fit; BudgetError
    when even all of them do not fit.

    Why a baseline of its own: on a transformer this plan costs a few percent of the step and is
    where the exact solver should start. The others start it far from there: checkpointing
    blocks and Chen's segments recompute matmuls, and on the 7B demo (1,723 candidates, 30 s)
    CP-SAT started from greedy's 24.6 ms plan, which recomputed all 32 attentions, stopped at
    23.4 ms; started from this one (7.8 ms, none), it reaches 6.5 ms."""
    order = sorted((v for v in recomputable(problem) if not does_flops(problem, v)),
                   key=lambda v: (unit_cost(problem, v) / problem.ops[v].size, v))
    return _cheapest_prefix(problem, order, budget, Strategy.SELECTIVE, deadline)


# The baselines by name: the rows of the solver's table (`remat.solvers.entry.STRATEGIES`) and
# the strategies the exact search starts from (`remat.solvers.cpsat.hints.HINT_POOL`).
BY_STRATEGY: MappingProxyType[Strategy, StrategyFn] = MappingProxyType({
    Strategy.SAVE_ALL: save_all, Strategy.CHECKPOINT_BLOCKS: checkpoint_blocks,
    Strategy.CHEN_SQRT: chen_sqrt, Strategy.GREEDY: greedy, Strategy.SELECTIVE: selective})
