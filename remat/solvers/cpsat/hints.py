"""The schedules the search starts from: the baselines of the hint pool, run within a share of
the time limit (those that cannot finish in it are skipped and named), and the drop pass that
takes out the recomputations a hint can do without.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from remat.errors import BudgetError
from remat.solvers import baselines  # noqa: F401  (registers the pool's strategies)
from remat.solvers.options import SolverOptions
from remat.solvers.problem import Kind, Problem
from remat.solvers.strategies import STRATEGIES, Strategy
from remat.solvers.schedule import Schedule, drop_unneeded, make_schedule

logger = logging.getLogger(__name__)

# The strategies whose schedules may start the search, cheapest to run first. One tuple, so that
# a new strategy joins by being named here. checkpoint_blocks stays in it: near the floor it is
# often the only baseline that fits.
HINT_POOL = (Strategy.SAVE_ALL, Strategy.CHECKPOINT_BLOCKS, Strategy.CHEN_SQRT,
             Strategy.SELECTIVE, Strategy.GREEDY)
BASELINES = HINT_POOL  # the name the benchmarks and tests know the pool by
# Schedule evaluations (make_schedule + simulate) a strategy is expected to run, to predict
# whether it can finish in the time left: one for a fixed plan, a prefix search for the rest.
EVALUATIONS = {Strategy.SAVE_ALL: 1, Strategy.CHECKPOINT_BLOCKS: 1, Strategy.CHEN_SQRT: 1}
PREFIX_SEARCH_EVALUATIONS = 40


@dataclass
class Pool:
    """Runs the hint pool's strategies against a deadline; remembers what it skipped and why."""

    problem: Problem
    options: SolverOptions
    skipped: dict[str, str] = field(default_factory=dict)
    seconds_per_evaluation: float | None = None

    def run(self, budget: int, deadline: float, until_one_fits: float | None = None
            ) -> list[Schedule]:
        """Every pool strategy's schedule at `budget` (those that fit), each run only when it
        is predicted to finish before `deadline`, or before `until_one_fits` while none fits
        (a plan late is better than none)."""
        found = []
        for strategy in HINT_POOL:
            if strategy not in STRATEGIES:
                continue
            if not found and until_one_fits is not None:
                deadline = max(deadline, until_one_fits)
            expected = EVALUATIONS.get(strategy, PREFIX_SEARCH_EVALUATIONS) * (
                self.seconds_per_evaluation or 0.0)
            now = time.perf_counter()
            if now + expected > deadline:
                self.skipped[strategy.value] = (f"would take about {expected:.1f} s, "
                                                f"{max(0.0, deadline - now):.1f} s left")
                continue
            try:
                found.append(STRATEGIES[strategy](self.problem, budget, self.options))
                self.skipped.pop(strategy.value, None)
            except BudgetError:
                pass
            finally:
                spent = time.perf_counter() - now
                if self.seconds_per_evaluation is None:  # the first is a single evaluation
                    self.seconds_per_evaluation = spent / EVALUATIONS.get(strategy, 1)
        return found

    def best(self, budget: int, deadline: float, until_one_fits: float | None = None
             ) -> Schedule | None:
        """The cheapest fitting schedule of the pool, least peak among equals."""
        return min(self.run(budget, deadline, until_one_fits), key=lambda s: (s.cost, s.peak),
                   default=None)

    def least_peak(self, deadline: float) -> Schedule | None:
        """The pool's schedule of least peak, each strategy at a budget it always meets."""
        unbounded = sum(op.size + op.temp for op in self.problem.ops)
        return min(self.run(unbounded, deadline), key=lambda s: (s.peak, s.cost), default=None)


def _best_baseline(problem: Problem, budget: int, options: SolverOptions) -> Schedule | None:
    """The best baseline of the pool at `budget`, with no deadline (tests, benchmarks)."""
    return Pool(problem, options).best(budget, float("inf"))


def drop_pass(problem: Problem, budget: int, hint: Schedule, deadline: float) -> Schedule:
    """The hint with every recomputation it can do without, most expensive first, until none
    can go or the deadline: a local search evaluated by `simulate` (through make_schedule).
    The baselines recompute whole blocks; most of that is not needed to fit, and CP-SAT's
    neighbourhood search takes tens of seconds to find what this finds in one (505 ops,
    checkpoint_blocks at half the save-all peak: 3.96 -> 3.53 ms in 1 s)."""
    best = hint
    recomputed = set(hint.recomputed)
    improved = True
    while improved and time.perf_counter() < deadline:
        improved = False
        for v in sorted(recomputed, key=lambda v: -problem.ops[v].cost):
            if v not in recomputed or problem.ops[v].kind is Kind.TUPLE:
                continue  # gone with an earlier drop; a tuple op goes with its getitems
            if time.perf_counter() >= deadline:
                break
            try:
                trial = make_schedule(problem, drop_unneeded(problem, recomputed - {v}),
                                      strategy=hint.strategy, status=hint.status, budget=budget)
            except ValueError:
                continue  # e.g. a getitem dropped while its tuple op stays recomputed
            if trial.peak <= budget and trial.cost < best.cost:
                best, recomputed, improved = trial, set(trial.recomputed), True
    return best
