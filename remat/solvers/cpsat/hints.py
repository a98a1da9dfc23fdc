"""The schedules the search starts from: the baselines of the hint pool, run within a share of
the time limit (those that cannot finish in it are skipped and named), and the drop pass that
takes out the recomputations a hint can do without.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Collection

from remat.errors import BudgetError
from remat.solvers.core.deadline import Deadline, OutOfTime, modelled
from remat.solvers.core.options import SolverOptions
from remat.solvers.core.problem import Kind, Problem
from remat.solvers.baselines.standard import BY_STRATEGY
from remat.solvers.core.strategy import Strategy
from remat.solvers.core.schedule import Schedule, drop_unneeded
from remat.solvers.timeline.evaluate import make_schedule

logger = logging.getLogger(__name__)

# The strategies whose schedules may start the search, cheapest to run first. One tuple, so that
# a new strategy joins by being named here. checkpoint_blocks stays in it: near the floor it is
# often the only baseline that fits.
HINT_POOL = (Strategy.SAVE_ALL, Strategy.CHECKPOINT_BLOCKS, Strategy.CHEN_SQRT,
             Strategy.SELECTIVE, Strategy.GREEDY)
BASELINES = HINT_POOL  # the name the benchmarks and tests know the pool by
# Schedule evaluations (make_schedule + simulate) a strategy is expected to run, to predict
# whether it can finish in the time left: one for a fixed plan; a prefix search (PeakMeter's
# evaluations are cheaper: greedy took 5 to 10 at 2,000 to 5,000 ops) stops at the deadline
# anyway, so it is predicted on the low side.
EVALUATIONS = {Strategy.SAVE_ALL: 1, Strategy.CHECKPOINT_BLOCKS: 1, Strategy.CHEN_SQRT: 1}
PREFIX_SEARCH_EVALUATIONS = 8


@dataclass
class Pool:
    """Runs the hint pool's strategies against a deadline; remembers what it skipped and why."""

    problem: Problem
    options: SolverOptions
    skipped: dict[str, str] = field(default_factory=dict)
    seconds_per_evaluation: float | None = None
    fixed: dict[Strategy, Schedule] = field(default_factory=dict)  # fixed plans, any peak

    def evaluation(self, deterministic: bool) -> float:
        """Seconds one schedule evaluation takes on the problem, to predict a stage's time:
        measured on the first baseline, or modelled (deterministic mode, and before that)."""
        if deterministic or self.seconds_per_evaluation is None:
            return modelled("evaluation", len(self.problem))
        return self.seconds_per_evaluation

    def run(self, budget: int, deadline: Deadline, until_one_fits: Deadline | None = None,
            only: Collection[str] | None = None) -> list[Schedule]:
        """Every pool strategy's schedule at `budget` (those that fit), each run only when it
        is predicted to finish before `deadline`, or before `until_one_fits` while none fits
        (a plan late is better than none); a prefix search that runs past it is stopped.
        `only`: the strategies (their values) to run, each whatever its predicted time, while
        the deadline has not passed; all of the pool's, as predicted, by default."""
        found = []
        for strategy in HINT_POOL:
            if strategy not in BY_STRATEGY or (only is not None and strategy.value not in only):
                continue
            part = deadline
            if not found and until_one_fits is not None and until_one_fits.end > deadline.end:
                part = until_one_fits
            evaluations = EVALUATIONS.get(strategy, PREFIX_SEARCH_EVALUATIONS)
            expected = evaluations * self.evaluation(part.deterministic)
            if (expected > part.left() and only is None) or part.expired():
                self.skipped[strategy.value] = (f"would take about {expected:.1f} s, "
                                                f"{part.left():.1f} s left")
                continue
            began = time.perf_counter()
            try:
                if strategy in EVALUATIONS:  # a fixed plan: one evaluation, nothing to stop
                    found.append(BY_STRATEGY[strategy](self.problem, budget, self.options))
                else:
                    found.append(BY_STRATEGY[strategy](self.problem, budget, self.options,
                                                      deadline=part))
                self.skipped.pop(strategy.value, None)
            except BudgetError:
                pass
            except OutOfTime:
                before = self.skipped.get(strategy.value)  # why it was skipped the first time
                self.skipped[strategy.value] = (f"{before}; then run in the time left, stopped "
                                                "at the deadline" if before else
                                                "stopped at the deadline")
            finally:
                part.charge(evaluations * modelled("evaluation", len(self.problem)))
                if self.seconds_per_evaluation is None:  # the first is a single evaluation
                    spent = time.perf_counter() - began
                    self.seconds_per_evaluation = spent / EVALUATIONS.get(strategy, 1)
        return found

    def best(self, budget: int, deadline: Deadline, until_one_fits: Deadline | None = None
             ) -> Schedule | None:
        """The cheapest fitting schedule of the pool, least peak among equals."""
        return min(self.run(budget, deadline, until_one_fits), key=lambda s: (s.cost, s.peak),
                   default=None)

    def second_chance(self, hint: Schedule | None, budget: int, deadline: Deadline
                      ) -> Schedule | None:
        """The better of `hint` (if it fits) and the strategies skipped so far for want of time,
        these run before `deadline`, which stops them (a prediction on a loaded machine is
        pessimistic: greedy at 5,005 ops predicted 4 s, took 0.7): the time that the stages
        after the pool could not use goes to the baselines they would have beaten. 5,005 ops at
        70 % of the save-all peak, two busy processes beside: checkpoint_blocks was returned at
        39.4 ms where greedy, skipped, finds 13.3 ms."""
        found = min(self.run(budget, deadline, only=set(self.skipped)),
                    key=lambda s: (s.cost, s.peak), default=None)
        if hint is not None and hint.peak <= budget and (
                found is None or (hint.cost, hint.peak) <= (found.cost, found.peak)):
            return hint
        return found if found is not None else hint

    def last_resort(self, budget: int) -> Schedule | None:
        """A plan that fits `budget`, run whatever the time left: the first fixed-plan baseline
        skipped for time that fits, else per-block checkpointing (`per_block`) where it fits,
        whether the pool ran it or not (one evaluation; near the floor often the only baseline
        that fits). Where a loaded machine left the call no time for any plan (the 70B beside
        two busy processes, its solve left 10 s after a 20 s capture: every baseline skipped),
        a plan one evaluation late beats an error; and no time never hides a plan that
        checkpointing every block already fits. None: neither fits."""
        for strategy in EVALUATIONS:
            skipped = strategy.value in self.skipped
            if (not skipped and strategy is not Strategy.CHECKPOINT_BLOCKS) \
                    or strategy not in BY_STRATEGY:
                continue
            found = (self.per_block() if strategy is Strategy.CHECKPOINT_BLOCKS
                     else self.fixed_plan(strategy))
            if found.peak > budget:
                continue
            if skipped:
                self.skipped[strategy.value] += "; then run past the deadline: nothing else fitted"
            return found
        return None

    def per_block(self) -> Schedule:
        """Per-block checkpointing's plan whatever its peak (one evaluation, kept): the last
        resort, and where it does not fit, the least peak known for the error."""
        return self.fixed_plan(Strategy.CHECKPOINT_BLOCKS)

    def fixed_plan(self, strategy: Strategy) -> Schedule:
        """A fixed-plan baseline's schedule whatever its peak (one evaluation, kept)."""
        if strategy not in self.fixed:
            unbounded = sum(op.size + op.temp for op in self.problem.ops)
            self.fixed[strategy] = BY_STRATEGY[strategy](self.problem, unbounded, self.options)
        return self.fixed[strategy]

    def least_peak(self, deadline: Deadline) -> Schedule | None:
        """The pool's schedule of least peak, each strategy at a budget it always meets."""
        unbounded = sum(op.size + op.temp for op in self.problem.ops)
        return min(self.run(unbounded, deadline), key=lambda s: (s.peak, s.cost), default=None)


def _best_baseline(problem: Problem, budget: int, options: SolverOptions) -> Schedule | None:
    """The best baseline of the pool at `budget`, with no deadline (tests, benchmarks)."""
    return Pool(problem, options).best(budget, Deadline(math.inf))


def drop_pass(problem: Problem, budget: int, hint: Schedule, deadline: Deadline) -> Schedule:
    """The hint with every recomputation it can do without, most expensive first, until none
    can go or the deadline: a local search evaluated by `simulate` (through make_schedule), each
    evaluation charged to the deadline (deterministic mode).
    The baselines recompute whole blocks; most of that is not needed to fit, and CP-SAT's
    neighbourhood search takes tens of seconds to find what this finds in one (505 ops,
    checkpoint_blocks at half the save-all peak: 3.96 -> 3.53 ms in 1 s)."""
    best = hint
    recomputed = set(hint.recomputed)
    improved = True
    evaluation = modelled("evaluation", len(problem))
    while improved and not deadline.expired():
        improved = False
        for v in sorted(recomputed, key=lambda v: (-problem.ops[v].cost, v)):
            if v not in recomputed or problem.ops[v].kind is Kind.TUPLE:
                continue  # gone with an earlier drop; a tuple op goes with its getitems
            if deadline.expired():
                break
            deadline.charge(evaluation)
            try:
                trial = make_schedule(problem, drop_unneeded(problem, recomputed - {v}),
                                      strategy=hint.strategy, status=hint.status, budget=budget)
            except ValueError:
                continue  # e.g. a getitem dropped while its tuple op stays recomputed
            if trial.peak <= budget and trial.cost < best.cost:
                best, recomputed, improved = trial, set(trial.recomputed), True
    return best
