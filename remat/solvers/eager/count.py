"""The slot relaxation's count rounds: a lower bound on the number of recomputations that run,
weighted by whole quanta of their costs, which CP-SAT proves in far less time than the least
cost, and which makes the least cost's linear relaxation nearly tight once it is a row.

Bamba's costs are kernel launches: 178 of its 192 cache units cost 1.00e6 to 1.05e6 units,
the rest nothing. At the nine slots of its hard round (`slots`), the least cost's linear
relaxation is 24.2e6 against an optimum of 28.7e6, and CP-SAT took 3 to 30 s to prove it; the
least count of the launches that run (every weight 1) was proven to be 28 in 0.7 to 1 s on one
worker (its linear relaxation: 23.5), and with "at least 28 run" as a row, the least cost's
linear relaxation is 28.66e6 (CP-SAT's root bound, 0.2 s).

Both rows are valid for every policy: the count is the least over the policies that fit at the
slots checked, so every policy that fits everywhere counts at least as many; every cost is at
least its weight times the quantum, so the quantum times the count bounds the cost too.
"""
from __future__ import annotations

import logging
import math

from ortools.sat.python import cp_model

from remat.solvers.cpsat.search import cp_solver
from remat.solvers.core.deadline import Deadline
from remat.solvers.core.options import SolverOptions

log = logging.getLogger(__name__)

# The weights are at most this many quanta (`count_weights`).
MAX_COUNT_WEIGHT = 16
# The slots that join at each count round: the count's policy's highest above the capacity.
# Bamba's first count policy overflows at five: with all of them, the count is 28 in two rounds
# (0.17 % at 10 s, three runs of three at a load of 6 to 7.5); with 3 a round, in three, and the
# third was cut (7.1 % in the same three runs); 1 or 2 a round took longer still.
COUNT_SLOTS_PER_ROUND = 8


def count_weights(costs: list[int]) -> tuple[int, list[int]]:
    """A quantum q and each cost's whole quanta, floor(cost / q), at most MAX_COUNT_WEIGHT: q
    is the least positive cost, or the largest cost over MAX_COUNT_WEIGHT where that is more.
    Every cost is at least q times its weight. (0, zeros) where no cost is positive."""
    positive = [c for c in costs if c > 0]
    if not positive:
        return 0, [0] * len(costs)
    quantum = max(min(positive), -(-max(positive) // MAX_COUNT_WEIGHT))
    return quantum, [c // quantum for c in costs]


class CountRows:
    """The weighted count of a relaxation's running recomputations (`relax.count`, with
    `relax.quantum`), its least value proven so far as a row of `relax.m`, and the least
    cost's root bound under it."""

    def __init__(self, relax, options: SolverOptions, solve):
        self.relax, self.options, self.solve = relax, options, solve
        self.least = 0

    def rounds(self, deadline: Deadline, levels_of, capacity: int, met) -> tuple[float, int]:
        """Count rounds from the relaxation's slots: each proves the least count, and where
        that is more than before, the least cost's root bound under it; then the slots where
        the count's policy (`levels_of(cached)`: its bytes per slot) is highest above
        `capacity` join. They stop where a round proves no more than the one before, where the
        count's policy fits, where `met(bound)`, or at the deadline. Returns (the bound, the
        rounds run); the bound is inf where no policy fits at the slots."""
        relax, bound, rounds = self.relax, 0.0, 0
        while deadline.check("eager: slot bound, count"):
            rounds += 1
            before = self.least
            status, cached = self.round(deadline)
            if status == cp_model.INFEASIBLE:
                return math.inf, rounds
            if cached is None or (rounds > 1 and self.least == before):
                break  # cut by the deadline, or more slots proved no more
            if deadline.check("eager: slot bound, root"):
                bound = max(bound, self.cost_bound(deadline))
            log.debug("eager slot bound: count at least %d, bound %d", self.least, bound)
            if met(bound) or status != cp_model.OPTIMAL:
                break
            levels = levels_of(cached)
            added = sorted((t for t, level in enumerate(levels)
                            if level > capacity and t not in relax.slots),
                           key=lambda t: -levels[t])[:COUNT_SLOTS_PER_ROUND]
            if not added:
                break  # the count's policy fits: its count is the least over every slot
            log.debug("eager slot bound: count adds %s", added)
            for t in added:
                relax.add_slot(t)
            relax.hint(cached)
        return bound, rounds

    def round(self, deadline: Deadline):
        """Solve the least count at the relaxation's slots: (status, its policy or None). Where
        it proves more than before, "count >= least" becomes a row."""
        relax = self.relax
        relax.m.Minimize(relax.count)
        try:
            solver = cp_solver(self.options, deadline, deadline.left())
            # One worker: 0.7 to 1 s where the 2-worker portfolio took 2.8 s (Bamba, nine
            # slots, a load of 5); its weights are small integers, and only its bound counts.
            solver.parameters.num_workers = 1
            solver.parameters.relative_gap_limit = 0.0
            status = self.solve(solver, relax.m, "slot bound, count")
        finally:
            relax.m.Minimize(relax.cost)
        log.debug("eager slot bound: count %s in %.2f s, at least %g, %d slots",
                  solver.StatusName(status), solver.WallTime(), solver.BestObjectiveBound(),
                  len(relax.slots))
        if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            return status, None
        least = math.ceil(solver.BestObjectiveBound() - 1e-6)
        if least > self.least:
            self.least = least
            relax.m.Add(relax.count >= least)
        return status, relax.decision(solver.Value)

    def cost_bound(self, deadline: Deadline) -> float:
        """The least cost's bound at CP-SAT's root (its linear relaxation with cuts, no
        search: 0.2 s), at least the quantum times the count; 0 where CP-SAT proved nothing."""
        relax = self.relax
        solver = cp_solver(self.options, deadline, deadline.left())
        solver.parameters.num_workers = 1
        solver.parameters.max_number_of_conflicts = 0
        # Without a hint: from a hinted solution CP-SAT searches on past the conflict limit
        # (Bamba at five slots: 6 s, against 0.05 s unhinted).
        hinted = relax.hinted
        relax.m.ClearHints()
        try:
            status = self.solve(solver, relax.m, "slot bound, root")
        finally:
            if hinted is not None:
                relax.hint(hinted)
        if status == cp_model.INFEASIBLE:
            return math.inf
        root = solver.BestObjectiveBound() if status != cp_model.MODEL_INVALID else 0.0
        return max(float(relax.quantum * self.least), root if math.isfinite(root) else 0.0)
