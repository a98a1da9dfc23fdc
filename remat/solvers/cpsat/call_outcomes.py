"""The outcomes of one call of strategy `optimal` (`remat.solvers.cpsat.driver._Call`): the
result with its true status, the best proven bound, and the ends where nothing fits (the
least-peak search, per-block checkpointing where the time allowed nothing else, BudgetError
naming the least peak found or proven). A mixin: it reads the call's problem, budget, options,
pool, units and deadline.
"""
from __future__ import annotations

import logging
import time
from dataclasses import replace
from types import MappingProxyType

from remat.errors import BudgetError
from remat.solvers.relaxation.bound import Bound
from remat.solvers.cpsat.least_peak import least_peak, too_small
from remat.solvers.cpsat.rich_search import full_cost
from remat.solvers.cpsat.search import deadline_info
from remat.solvers.core.deadline import Deadline
from remat.solvers.core.schedule import OPTIMAL_TOLERANCE, Schedule, Status
from remat.solvers.timeline.evaluate import evaluate
from remat.solvers.core.strategy import Strategy

__all__ = ["CallOutcomes"]

logger = logging.getLogger("remat.solvers.cpsat.driver")


class CallOutcomes:
    """How a call ends: its result, its bound, its failures."""

    def close_enough(self, hint: Schedule | None, bound: float) -> bool:
        """Whether `hint` fits and its true cost is proven within `options.relative_gap` of
        `bound`: the search may stop there, as CP-SAT does at that gap. Never at a gap of 0,
        even where the hint meets the bound: the search then still finds the least peak among
        the plans of that cost, which the stage after it proves."""
        if hint is None or hint.peak > self.budget or self.options.relative_gap <= 0:
            return False
        cost = full_cost(self.problem, hint)
        return cost - bound <= self.options.relative_gap * cost

    def result(self, schedule: Schedule, bound: float) -> Schedule:
        """`schedule` with its true status: OPTIMAL within OPTIMAL_TOLERANCE of `bound`."""
        self.progress.update(stage="done")
        self.info.update(deadline_info(self.deadline))
        cost = full_cost(self.problem, schedule)  # a caller's hint may be a rich schedule
        optimum = cost - bound <= OPTIMAL_TOLERANCE * cost
        return evaluate(self.problem, schedule, strategy=Strategy.OPTIMAL.value,
                        status=Status.OPTIMAL if optimum else Status.FEASIBLE,
                        budget=self.budget, bound=bound,
                        solve_time=time.perf_counter() - self.start,
                        info=MappingProxyType(self.info))

    def best_bound(self, searched: float, steps: Bound) -> float:
        """The higher of CP-SAT's bound and the one proven from backward steps;
        `info["bound_from"]` says which, for the report."""
        if steps.steps and steps.value > searched:
            self.info["bound_from"] = f"backward steps ({steps.where(self.problem)})"
            # A single step's bound holds over the rich space too (remat.solvers.cpsat.
            # rich_search uses it then); several steps together assume one decision a value.
            self.info["bound_steps"] = len(steps.steps)
            return steps.value
        self.info["bound_from"] = "CP-SAT search"
        self.info.pop("bound_steps", None)
        return searched

    def search_least_peak(self, model, deadline: Deadline, target: int = -1) -> None:
        if self.least is None:
            self.progress.update(stage="searching for the least peak")
            self.least, self.least_proven = least_peak(
                self.problem, self.units, self.options, self.pool, model, deadline, target,
                start=self.lowest[0] if self.lowest else None)

    def too_small(self) -> BudgetError:
        return too_small(self.problem, self.budget, self.least, self.least_proven, self.options,
                         self.work(), rich=(self.options.model != "single"
                                            and self.options.free_positions))

    def fail(self, model) -> Schedule:
        """Where the model (or a bound) finds nothing that fits: the least-peak schedule, which
        fits only where rounding made the model conservative; else BudgetError."""
        model = model or self.build()
        if model is not None:
            self.search_least_peak(model, self.work())
        elif self.least is None:  # no time to search: the pool's least peak, unproven
            self.least = self.pool.least_peak(self.work())
        if self.least is None or (self.least.peak > self.budget and not self.least_proven):
            return self.nothing_found("no time left for the least-peak search"
                                      if self.least is None else
                                      "the least-peak search found none that fits in the time")
        if self.least.peak > self.budget:
            raise self.too_small()
        return self.result(self.least, 0.0)

    def nothing_found(self, why: str, bound: float = 0.0) -> Schedule:
        """Where the time ran out before a plan that fits was found: per-block checkpointing
        (or a fixed plan skipped for time) where it fits (`Pool.last_resort`), HEURISTIC, with
        `why` in info["last_resort"]; else BudgetError naming the least peak known (that plan's
        or the least-peak search's), found and not proven unless the search proved it."""
        resort = self.pool.last_resort(self.budget)
        if resort is not None:
            self.info.update(skipped=dict(self.pool.skipped), hint=resort.strategy,
                             last_resort=f"{resort.strategy}, run past the deadline: {why}")
            found = self.result(resort, bound)
            logger.warning("optimal: no schedule found within %.1f s (%s); returning %s's",
                           self.limit, why, resort.strategy)
            return (found if found.status is Status.OPTIMAL
                    else replace(found, status=Status.HEURISTIC))
        blocks = self.pool.per_block()
        if self.least is None or blocks.peak < self.least.peak:
            self.least, self.least_proven = blocks, False
        raise self.too_small()
