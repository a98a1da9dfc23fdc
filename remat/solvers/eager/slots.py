"""The eager model checked at a few slots only: a relaxation whose least cost is a lower bound
on every policy's, grown slot by slot where its own policy overflows (row generation).

`EagerModel` checks the memory at every slot of the eager timeline, through a chain of
"held to slot k or later" literals per storage and a running level: thousands of variables
for two tiny transformer blocks (Gemma-2: 9,109), whose presolve alone took 3 s of a 10 s
limit on a busy machine, and whose linear relaxation proved little (DBRX: 57 % gap, its
optimum found only after 74 s). At one slot t, the same bytes are a knapsack over the cache
units: what no decision moves (`EagerModel.fixed`), the recomputation steps' temps that run,
and per storage held across t, its size times one boolean bounded below by every condition
(a conjunction of the model's literals) that holds it to t or later, in few rows
(`conditions`: Bamba's relaxation at five slots has 1,200 constraints where it had
48,000, and reaches the policy that fits in 20 to 27 s at a load of 7 where it took 44 s).
Dropping every other
slot's check leaves a relaxation (any policy that fits everywhere fits at the chosen slots),
so its least cost bounds the model's, exactly where it is solved to optimality and by
CP-SAT's proven bound otherwise. Where its policy fits at every slot (`EagerModel.peak_of`),
that policy is optimal; else the slot where it peaks highest above the capacity joins (one a
round: adding several made the rounds harder than the rounds they saved; Gemma-3 alone, at a
load of 7: 4.3 s to its eighth round one slot at a time, 9.4 s three at a time), a floor at the
bound so far is added (more slots cost no less), and the relaxation is solved again. A round's
policy that overflows is handed to `repair` (the caller's: the heuristic's repair and improvement),
whose policy, where it fits, is the plan when it meets the bound; a repair that finds nothing
cheaper than the best policy known is not tried again. A start that fits (the heuristic's policy) is
the best policy known from the outset, and its tightest slots (`tightest`) start the relaxation: the
cheapest policy tends to be tight there too (DBRX: its relaxed policy then fits in the first round,
the optimum, with no repair). The rounds are solved LP-first, as the whole model is
(`cp_run.lp_first`: Bamba's seventh slot took 19 s to prove without, 1.8 s with).

A storage that a recomputation reads is held until then by its original or by its copy: each
alone is a conjunction in the model's literals, which a fractional policy escapes in the
linear relaxation; their sum is at least "the reader runs" (`EagerModel.pairs`), added at the
slots checked.

On the zoo's eager problems (`benchmarks/eager_gap.py`, each solved alone at 7.5 s on a busy
machine): DBRX is proven optimal in the first round (the whole model proved it in
74 s), Swin is proven optimal, Gemma, Gemma-2, Gemma-3 and Qwen3 come within 0.4 %. Bamba's
cost rounds climbed a round at a time down one recomputation of its Mamba scan, and the round
that adds the ninth slot (520) took 3 to 17 s alone, the linear relaxation there being at 25e6
units where its optimum is 28.7e6: 7 to 10 % in 10 s. The count rounds (`count`), run
first, prove that 28 of its kernel launches run in two rounds, and the least cost's root bound
under that row is within 0.2 % of its plan: 0.14 to 0.17 % at 10 s at a load of 5 to 7.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from ortools.sat.python import cp_model

from remat.solvers.eager.conditions import HeldConditions
from remat.solvers.eager.count import CountRows, count_weights
from remat.solvers.eager.decisions import TRUE, literal_value
from remat.solvers.cpsat.search import cp_solver
from remat.solvers.core.deadline import Deadline
from remat.solvers.core.options import SolverOptions

log = logging.getLogger(__name__)

# The slots above the capacity that join the relaxation at each round (`overflowing`).
SLOTS_PER_ROUND = 1
# The relative gap to which each round is solved (its bound is CP-SAT's proven one whatever).
ROUND_GAP = 0.002
# The slots a start that fits adds (`tightest`): the peaks of its highest runs of slots within
# TIGHT_MARGIN of the capacity (Bamba: its relaxed policy fit after 17 s with 4, 30 s with 8).
TIGHT_SLOTS = 4
TIGHT_MARGIN = 0.03


@dataclass
class SlotBound:
    """What the relaxation proved and found: `bound` in cost units (the model's objective,
    without `EagerModel.fixed_cost`), `cached` the last relaxed policy that fits at every slot
    (None: none did), `optimal` whether that policy's cost meets the bound, to the options'
    relative gap (the search over every slot need not run), and the slots it checked."""

    bound: float
    cached: frozenset[int] | None
    optimal: bool
    slots: tuple[int, ...]
    rounds: int


class SlotRelaxation:
    """`model` (an `EagerModel`) checked only at the slots added with `add_slot`, in a CP-SAT
    model of its own (the cache units' booleans, the literals defined from them that the
    conditions read, and one boolean per storage and slot it may be held at)."""

    def __init__(self, model, capacity: int):
        self.full, self.capacity = model, capacity
        self.m = m = cp_model.CpModel()
        self._defs: dict[int, tuple] = {}
        for runs, lits in model._some_uncached:
            self._defs[runs.Index()] = ("some", lits)
        for x, none, runs in model._none_defs:
            self._defs[x.Index()] = ("none", none, runs)
        self._vars: dict[int, cp_model.IntVar] = {}
        self.cache = {unit: self._lit(x) for unit, x in model.cache.items()}
        self._held: dict[tuple[int, int], cp_model.IntVar] = {}
        self._conditions = HeldConditions(model, self._lit, m)
        self.slots: list[int] = []
        self.hinted: set[int] | None = None  # the policy the solves start from (`hint`)
        moving = [(v, lit) for v, lit in model.runs_lit.items() if lit is not TRUE]
        ops, units = model.problem.ops, model.units
        costs = [units.cost_of(ops[v].cost) for v, _ in moving]
        running = [self._lit(lit) for _, lit in moving]
        self.cost = cp_model.LinearExpr.WeightedSum(running, costs)
        # The recomputations that run, weighted by whole quanta of their costs (`count`).
        self.quantum, weights = count_weights(costs)
        self.count = cp_model.LinearExpr.WeightedSum(running, weights)
        m.Minimize(self.cost)

    def _var(self, index: int) -> cp_model.IntVar:
        """The relaxation's boolean for the model's variable `index`, with its definition where
        it is one (a multi-output call that runs; no slot running since a start)."""
        if index in self._vars:
            return self._vars[index]
        m = self.m
        x = self._vars[index] = m.NewBoolVar(f"v{index}")
        kind = self._defs.get(index)
        if kind is not None and kind[0] == "some":  # runs exactly when some unit is not cached
            lits = [self._lit(y) for y in kind[1]]
            m.AddBoolOr([y.Not() for y in lits]).OnlyEnforceIf(x)
            m.AddBoolAnd(lits).OnlyEnforceIf(x.Not())
        elif kind is not None:  # x = none and not runs
            none, runs = kind[1], self._lit(kind[2])
            m.AddImplication(x, runs.Not())
            if none is TRUE:
                m.AddBoolOr([x, runs])
            else:
                none = self._lit(none)
                m.AddImplication(x, none)
                m.AddBoolOr([x, none.Not(), runs])
        return x

    def _lit(self, x):
        index = x.Index()
        return self._var(index) if index >= 0 else self._var(-index - 1).Not()

    def held(self, i: int, t: int):
        """Hold `i` of the model at slot t: TRUE (whatever the decisions), None (never), or the
        relaxation's literal bounded below by every condition that holds it to t or later."""
        full, h = self.full, self.full.holds[i]
        if t < h.start:
            return None
        if t <= max([h.start] + [k for k, lits in h.terms if not lits]):
            return h.presence if h.presence is TRUE else self._lit(h.presence)
        later = [k for k, _ in full.ends[i] if k >= t]
        if not later:
            return None
        key = (i, later[0])  # the model's literal "held to later[0] or after" covers t
        if key not in self._held:
            y = self._held[key] = self.m.NewBoolVar(f"held[{i},{later[0]}]")
            for lits in self._conditions.of(i, t):
                self.m.Add(y >= sum(lits) - (len(lits) - 1))
        return self._held[key]

    def level_terms(self, t: int) -> list[tuple[int, object]]:
        """The bytes (units) at slot t that decisions move: (coefficient, relaxation literal);
        what is TRUE is in `EagerModel.fixed` already."""
        terms = []
        for i, h in enumerate(self.full.holds):
            x = self.held(i, t)
            if x is not None and x is not TRUE:
                terms.append((h.size, x))
        return terms + [(c, self._lit(x)) for c, x in self.full.temp_at.get(t, ())]

    def add_slot(self, t: int) -> None:
        if t in self.slots:
            return
        self.slots.append(t)
        terms = self.level_terms(t)
        self.m.Add(sum(c * x for c, x in terms) <= self.capacity - self.full.fixed[t])
        # A storage that a recomputation at k reads is held from its copy's start to k by
        # the original or the copy (`EagerModel.pairs`): implied for whole policies, but the
        # linear relaxation sees each alone as a conjunction, which a fraction escapes.
        for index, reads in self.full.pairs:
            for k, lit in reads:
                if self.full.holds[index + 1].start <= t <= k:
                    either = [self.held(index, t), self.held(index + 1, t)]
                    if any(x is TRUE for x in either):
                        continue
                    self.m.Add(sum(x for x in either if x is not None)
                               >= (1 if lit is TRUE else self._lit(lit)))

    def hint(self, cached) -> None:
        self.m.ClearHints()
        self.hinted = cached = set(cached)
        for unit, x in self.cache.items():
            self.m.AddHint(x, int(bool(cached.intersection(unit))))

    def decision(self, value) -> frozenset[int]:
        return frozenset(v for unit, x in self.cache.items() if value(x) for v in unit)


def slot_levels(model, cached) -> list[int]:
    """The bytes (units) at each slot of the policy caching `cached`, 0 where the slot does
    not run (`EagerModel.peak_of`, slot by slot)."""
    values = model.assignment(cached)
    return [b if x is TRUE or literal_value(values, x) else 0
            for b, x in zip(model.levels(values), model.active)]


def overflowing(levels: list[int], capacity: int, count: int) -> list[int]:
    """Slots to check next, from the levels of a policy that overflows: the highest slot of
    the highest run of slots above `capacity`, then up to `count - 1` more of that run,
    spread over it from its highest: a relaxed
    policy that fits at one slot of a recomputation tends to overflow at the step before it,
    one round at a time (Gemma-3: eight rounds down one recomputation)."""
    runs: list[list[int]] = []
    for t, level in enumerate(levels):
        if level > capacity:
            if t and levels[t - 1] > capacity:
                runs[-1].append(t)
            else:
                runs.append([t])
    if not runs:
        return []
    run = sorted(max(runs, key=lambda r: max(levels[t] for t in r)), key=lambda t: -levels[t])
    return run[::max(1, len(run) // count)][:count]


def tightest(levels: list[int], capacity: int, count: int) -> list[int]:
    """The highest slot of each of the `count` highest runs of slots within TIGHT_MARGIN of
    `capacity`, from the levels of a policy that fits."""
    runs: list[list[int]] = []
    for t, level in enumerate(levels):
        if level >= (1 - TIGHT_MARGIN) * capacity:
            if runs and runs[-1][-1] == t - 1:
                runs[-1].append(t)
            else:
                runs.append([t])
    peaks = [max(run, key=lambda t: levels[t]) for run in runs]
    return sorted(peaks, key=lambda t: -levels[t])[:count]


def slot_bound(model, capacity: int, options: SolverOptions, deadline: Deadline,
               starts=(), solve=None, repair=None) -> SlotBound:
    """Row generation over the slots until a relaxed policy fits, the best policy found meets
    the bound, a solve is cut by the deadline, or nothing is left to add. `starts`: policies
    whose highest slot starts the relaxation (caching everything the model decides is always
    one; the last one hints the first solve). `solve(solver, cp_model, stage)`: runs a CP-SAT
    solve under the deadline (the caller's guard). `repair(cached)`: a policy that fits
    made from a relaxed one that does not, or None (the heuristic's repair)."""
    return _RowGeneration(model, capacity, options, deadline, solve, repair).run(starts)


class _RowGeneration:
    """One `slot_bound`: the relaxation, the bound proven so far, the rounds run, and the best
    policy known to fit at every slot."""

    def __init__(self, model, capacity: int, options: SolverOptions, deadline: Deadline,
                 solve, repair):
        self.model, self.capacity, self.options, self.deadline = model, capacity, options, deadline
        self.solve, self.repair = solve, repair
        self.relax = SlotRelaxation(model, capacity)
        self.best: frozenset[int] | None = None
        self.best_cost = math.inf
        self.bound, self.rounds = 0.0, 0
        self.repairing = repair is not None  # until a repair finds nothing cheaper

    def run(self, starts) -> SlotBound:
        """The starts' slots, the count rounds where the costs allow them, then the rounds."""
        starts = [frozenset(self.model.decidable), *map(frozenset, starts)]
        self.add_start_slots(starts)
        self.relax.hint(starts[-1])
        counts = (CountRows(self.relax, self.options, self.solve) if self.relax.quantum
                  else None)
        if counts is not None:
            ended = self.count_rounds(counts, starts[-1])
            if ended is not None:
                return ended
        while self.deadline.check("eager: slot bound"):
            ended = self.round()
            if ended is not None:
                return ended
        return self.done()

    def add_start_slots(self, starts: list[frozenset[int]]) -> None:
        """Each start's highest slot above the capacity; for one that fits, its tightest
        slots, and it is the best policy known where it costs least."""
        for cached in starts:
            levels = slot_levels(self.model, cached)
            added = overflowing(levels, self.capacity, 1)
            if not added:  # it fits: where it is tightest, the cheapest policy tends to be too
                added = tightest(levels, self.capacity, TIGHT_SLOTS)
                self.keep(cached)
            for t in added:
                self.relax.add_slot(t)

    def keep(self, cached: frozenset[int]) -> None:
        """`cached`, a policy that fits at every slot, is the best known where it costs less."""
        cost = self.model.units_cost(cached)
        if cost < self.best_cost:
            self.best, self.best_cost = cached, cost

    def done(self) -> SlotBound:
        """What the rounds proved and found; optimal where the best policy meets the bound to
        the options' gap, as CP-SAT's own search stops (DBRX's relaxed policy came within 44
        units of 77e6 above the count rounds' bound, and the search over every slot then took
        6 s to say so under load)."""
        return SlotBound(self.bound, self.best, self.met(self.bound), tuple(self.relax.slots),
                         self.rounds)

    def nothing_fits(self) -> SlotBound:
        """No policy fits at the slots checked: none fits at all."""
        return SlotBound(math.inf, None, False, tuple(self.relax.slots), self.rounds)

    def met(self, at_least: float) -> bool:
        """The best policy known meets the bound (to the options' relative gap, as CP-SAT's
        own search stops)."""
        return self.best_cost <= at_least * (1 + (self.options.relative_gap or 0))

    def count_rounds(self, counts: CountRows, last_start: frozenset[int]) -> SlotBound | None:
        """The count rounds first (`count`): Bamba's bound within 0.2 % after three, in
        3 s at a load of 5, where the cost rounds took 20 s and more to get there. The result
        where they end the call, else None (the cost rounds start above their bound)."""
        self.bound, self.rounds = counts.rounds(
            self.deadline, lambda cached: slot_levels(self.model, cached), self.capacity,
            self.met)
        if math.isinf(self.bound):
            return self.nothing_fits()
        if self.met(self.bound) or not self.deadline.check("eager: slot bound"):
            return self.done()
        self.relax.m.Add(self.relax.cost >= math.ceil(self.bound - 1e-6))
        self.relax.hint(self.best if self.best is not None else last_start)
        return None

    def round(self) -> SlotBound | None:
        """One round: solve the relaxation at its slots, keep its policy (or its repair) where
        it fits, and add the slot where it overflows most. The result where the round ends
        the call, else None."""
        self.rounds += 1
        solver = cp_solver(self.options, self.deadline, self.deadline.left())
        # A round's policy only shows where to check next: near its optimum is enough.
        solver.parameters.relative_gap_limit = max(self.options.relative_gap or 0.0, ROUND_GAP)
        status = self.solve(solver, self.relax.m, "slot bound")
        if status == cp_model.INFEASIBLE:
            return self.nothing_fits()
        if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            return self.done()
        self.bound = max(self.bound, solver.BestObjectiveBound())
        relaxed = self.relax.decision(solver.Value)
        relaxed_levels = slot_levels(self.model, relaxed)
        log.debug("eager slot bound: round %d, %d slots, %s in %.2f s, bound %d, its policy "
                  "peaks at %d of %d", self.rounds, len(self.relax.slots),
                  solver.StatusName(status), solver.WallTime(), self.bound,
                  max(relaxed_levels, default=0), self.capacity)
        cached, levels = self.repaired(relaxed, relaxed_levels)
        if levels is None or max(levels, default=0) <= self.capacity:
            self.keep(cached)
            if levels is not None:  # the relaxed policy fits
                if self.best_cost > self.bound and status == cp_model.OPTIMAL:
                    self.close(cached)
                return self.done()
        if self.met(self.bound) or status != cp_model.OPTIMAL:
            return self.done()  # met, or cut by the deadline: what it proved stands
        return self.add_overflowing(relaxed, relaxed_levels)

    def repaired(self, cached: frozenset[int], levels: list[int]
                 ) -> tuple[frozenset[int], list[int] | None]:
        """The round's policy and its levels, or where it overflows, the repair's policy that
        fits (its levels None: not the relaxation's)."""
        if (max(levels, default=0) > self.capacity and self.repairing
                and self.deadline.check("eager: slot bound, repair")):
            fixed = self.repair(cached)
            if fixed is not None:
                cached, levels = frozenset(fixed), None
            # A repair that finds nothing cheaper than the best policy known is not tried
            # again: it costs a second or more a round (Bamba: 1.2 s, and never cheaper
            # than the heuristic's policy, while its bound took ten rounds).
            self.repairing = fixed is not None and self.model.units_cost(fixed) < self.best_cost
        return cached, levels

    def close(self, cached: frozenset[int]) -> None:
        """Stopped at the round gap: the rest of the way is short from its policy (BERT: 171
        units of 23e6 left, 0.9 s of the search over every slot)."""
        self.relax.hint(cached)
        solver = cp_solver(self.options, self.deadline, self.deadline.left())
        if self.solve(solver, self.relax.m, "slot bound, closing") in (cp_model.OPTIMAL,
                                                                       cp_model.FEASIBLE):
            self.bound = max(self.bound, solver.BestObjectiveBound())

    def add_overflowing(self, relaxed: frozenset[int], levels: list[int]) -> SlotBound | None:
        """The slot where the relaxed policy overflows most joins, above a floor at the bound
        so far (more slots cost no less); the result where nothing is left to add."""
        added = [t for t in overflowing(levels, self.capacity, SLOTS_PER_ROUND)
                 if t not in self.relax.slots]
        if not added:  # cannot happen: the relaxed policy fits where checked
            return self.done()
        for t in added:
            self.relax.add_slot(t)
        self.relax.m.Add(self.relax.cost >= math.ceil(self.bound - 1e-6))
        self.relax.hint(relaxed)
        return None
