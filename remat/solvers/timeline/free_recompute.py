"""Saved values that a compiled step recomputes for free, taken after the solve.

A problem for a plan that Inductor compiles names (``source["free_recompute"]``) the forward
values whose recomputation Inductor fuses into the backward kernels reading them: pointwise
values such as the masks of ReLU's backward, at no cost in the problem. Saving one costs
nothing in the objective either, so where a budget leaves room a strategy is free to save
it, and CP-SAT often does: the forward then writes it out and the backward reads it back,
where the backward could have computed it inside its readers from the inputs it holds anyway.
On the U-Net of `benchmarks/inductor.py` a plan saving seven ReLU masks beside the ReLU
outputs they are computed from ran its forward in 10.0 ms against 7.4 ms for a plan saving
three and 6.1 ms for torch.compile's, which saves only masks it could not recompute for free
(fastest quarter of fifteen steps, torch 2.13 CPU; a script not in the repository).

`take_free_recomputations` recomputes each such saved value whose inputs the plan saves,
where the simulated peak stays within the budget: the time objective would choose the same
if it priced the saved copy's write and read. The simulator holds a recomputed copy serving
one op at no bytes, but that op reads its inputs, which may so be held longer: the U-Net's
last mask, recomputed, holds the 1 MiB ReLU output it is computed from past the convolution's
backward, as torch.compile's plan does. The cost stays (the values cost nothing), so a proven bound
stays proven; the recompute FLOPs grow by the values' own (none: pointwise ops count none).
"""
from __future__ import annotations

from dataclasses import replace
from types import MappingProxyType
from typing import Iterable

from remat.solvers.core.problem import Problem
from remat.solvers.core.schedule import Schedule, latest_positions
from remat.solvers.timeline.evaluate import make_schedule

__all__ = ["MAX_GROUPS", "take_free_recomputations"]

# The fewest values a group is halved down to is the candidates' count over this: at most
# about 2 x MAX_GROUPS simulations where few fit, each one of the whole step. One by one, a
# Llama-70B's compiled problem (17,586 ops, 241 candidates) took 15.7 s where none fit.
MAX_GROUPS = 8


def take_free_recomputations(problem: Problem, schedule: Schedule, budget: int) -> Schedule:
    """`schedule` recomputing the saved free values (`Problem.fused_recomputations`) whose
    inputs it saves, all at once where the simulated peak stays at most `budget` bytes, else
    by halves in forward order, each taken where it fits (`_taking`). A schedule that runs
    values again or offloads is returned as it is."""
    free = problem.fused_recomputations
    if not free or schedule.again or schedule.offload_at:
        return schedule
    saved, root = schedule.saved, problem.root
    takes = [v for v in sorted(free & saved)
             if all(root[u] in saved or root[u] in problem.pinned
                    for u in problem.ops[v].inputs)]
    if not takes:
        return schedule
    smallest = -(-len(takes) // MAX_GROUPS)
    taken = _taking(problem, schedule, takes, budget, smallest)
    count = len(taken.recomputed) - len(schedule.recomputed)
    if not count:
        return schedule
    return replace(taken, info=MappingProxyType({**schedule.info, "free_recomputations": count}))


def _taking(problem: Problem, schedule: Schedule, values: list[int], budget: int,
            smallest: int) -> Schedule:
    """`schedule` recomputing `values` too where its simulated peak stays within `budget`;
    else each half of them in turn, down to groups of `smallest` values, left saved."""
    trial = _recomputing(problem, schedule, values)
    if trial.peak <= budget:
        return trial
    if len(values) <= smallest:
        return schedule
    half = len(values) // 2
    schedule = _taking(problem, schedule, values[:half], budget, smallest)
    return _taking(problem, schedule, values[half:], budget, smallest)


def _recomputing(problem: Problem, schedule: Schedule, values: Iterable[int]) -> Schedule:
    """`schedule` with `values` recomputed too, each just before its first reader that needs
    it; the other recomputations where they were."""
    positions = latest_positions(problem, set(values), problem.storage_readers,
                                 placed=schedule.recompute_at)
    return make_schedule(problem, set(positions), recompute_at=positions,
                         strategy=schedule.strategy, status=schedule.status,
                         budget=schedule.budget, bound=schedule.bound,
                         solve_time=schedule.solve_time, info=schedule.info)
