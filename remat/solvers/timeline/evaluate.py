"""A decision priced: `make_schedule` decides (`remat.solvers.core.schedule.decide`), checks that
every further copy is read, and fills in the cost, the recompute FLOPs, the transfers' time and
the simulated peak (`evaluate`). Every strategy's schedule passes through here, so the price of
a plan is the timeline's: what `simulate` holds and what `overlap` waits for."""
from __future__ import annotations

from dataclasses import replace
from typing import Iterable, Mapping

from remat.errors import SolverError
from remat.solvers.core.problem import Problem
from remat.solvers.core.schedule import Schedule, decide
from remat.solvers.timeline.overlap import transfers
from remat.solvers.timeline.simulate import copies_of, simulate, step_order

__all__ = ["check_host_memory", "evaluate", "make_schedule", "price"]


def make_schedule(problem: Problem, recomputed: Iterable[int], *,
                  recompute_at: Mapping[int, int] | None = None,
                  again: Mapping[int, Iterable[int]] | None = None,
                  offload_at: Mapping[int, int] | None = None, **fields) -> Schedule:
    """`decide`'s schedule (which values are saved, where each recomputation runs; ValueError
    for a decision that cannot run), evaluated: cost, FLOPs, simulated peak, and `fields`
    (strategy, status, budget, ...)."""
    schedule = decide(problem, recomputed, recompute_at=recompute_at, again=again,
                      offload_at=offload_at)
    _check_every_copy_read(problem, schedule)
    return evaluate(problem, schedule, **fields)


def _check_every_copy_read(problem: Problem, schedule: Schedule) -> None:
    """A further copy that no read is served by is an error, never silently paid for."""
    if not schedule.again:
        return
    for v, copies in copies_of(problem, schedule).items():
        if v in schedule.again and any(not c.reads for c in copies[1:]):
            raise ValueError(f"{problem.ops[v].name!r} is recomputed again where no later "
                             "reader uses that copy")


def check_host_memory(problem: Problem, schedule: Schedule) -> None:
    """Raise SolverError when a strategy returns a schedule whose offloads need more host
    memory than the problem has (`Problem.host_capacity`): a bug in the strategy."""
    capacity = problem.host_capacity
    held = sum(problem.ops[v].size for v in schedule.offload_at)
    if capacity is not None and held > capacity:
        raise SolverError(f"{schedule.strategy}: returned a schedule that keeps {held:,} bytes "
                          f"in host memory, above the host's {capacity:,}; this is a bug in "
                          "the strategy: please report it with the problem and the budget")


def evaluate(problem: Problem, schedule: Schedule, **fields) -> Schedule:
    """The schedule with its cost, recompute FLOPs and simulated peak filled in, and any other
    fields given (strategy, status, bound, budget, solve_time, info)."""
    cost, flops, transfer, exposed = _priced(problem, schedule)
    return replace(schedule, cost=cost, recompute_flops=flops, transfer_time=transfer,
                   exposed_time=exposed, peak=simulate(problem, schedule).peak, **fields)


def price(problem: Problem, schedule: Schedule) -> tuple[float, int, float]:
    """(cost, recompute FLOPs, transfer seconds) of `schedule`'s decisions on `problem`, without
    simulating memory: every run of a forward op again (the richer model's too), and what the
    step waits for its offloads' transfers (`remat.solvers.timeline.overlap`), which the cost
    includes; the transfer seconds are the transfers' own, both ways, hidden or not."""
    return _priced(problem, schedule)[:3]


def _priced(problem: Problem, schedule: Schedule) -> tuple[float, int, float, float]:
    ops = problem.ops
    runs = [*schedule.recomputed, *(v for v, ps in schedule.again.items() for _ in ps)]
    transfer = exposed = 0.0
    if schedule.offload_at:
        timeline = transfers(problem, schedule, step_order(problem, schedule))
        transfer, exposed = timeline.link_time, timeline.exposed
    return (sum(ops[v].cost for v in runs) + exposed, sum(ops[v].flops for v in runs),
            transfer, exposed)

