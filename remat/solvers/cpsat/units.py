"""What both CP-SAT models share: how bytes and seconds become integers (`Units`), the time axis
of the free model (`Axis`), and the rule that the backward gets every value it needs exactly
once (`provide_what_is_needed`).

Rounding is always in the safe direction. Sizes round UP and the capacity DOWN, so every
schedule a model accepts truly fits. Costs round DOWN, so that the model's objective never
exceeds a schedule's true cost and every bound CP-SAT proves on it is a bound on true costs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ortools.sat.python import cp_model

from remat.solvers.core.options import SolverOptions
from remat.solvers.core.problem import Kind, Problem
from remat.solvers.core.schedule import Schedule, drop_unneeded
from remat.solvers.timeline.evaluate import make_schedule

# Sizes are counted in integer units; beyond this many units in all, the unit grows.
MAX_UNITS = 2 ** 40
# The objective stays below this many cost units in all; beyond it the cost unit grows and the
# smallest costs may round to zero units (OPTIMAL is judged in true costs all the same). At
# 2**50 CP-SAT declared INFEASIBLE a second-stage model that the first stage's own solution
# satisfies (costs 1..10 at resolution 1e-9: the example kept in test_solvers_exact.py).
MAX_COST_UNITS = 2 ** 31


@dataclass(frozen=True)
class Units:
    """How bytes and seconds become the integers CP-SAT needs.

    Bytes: the unit is the gcd of every size and temp in the problem, so that the counts are
    exact (real problems: sizes share a factor of 2**k; tests: unit 1 or the gcd). Only when the
    total would exceed MAX_UNITS units does the unit grow to total / MAX_UNITS; then sizes are
    rounded UP and the capacity DOWN, so every schedule the model accepts truly fits (the model
    turns conservative by less than one unit per live storage, and says so in info["exact"]).
    `exact_rounding` is False then. `exact_bytes` is False then too, and also where the problem
    has values a compiled step fuses into their readers (`Problem.fused_recomputations`): the
    simulator holds a recomputed copy of one that serves one step at no bytes, and the
    free-positions and rich models hold such copies as buffers, so their bytes may be above
    the simulator's and what CP-SAT proves on them (a cost bound, a least peak, "nothing
    fits") need not hold. The just-in-time model counts them as the simulator does
    (`remat.solvers.cpsat.jit_fused`) and says so itself (`JitModel.exact`); the eager models
    judge by the eager timeline, where nothing is fused, and need `exact_rounding` alone.

    Cost: `options.cost_resolution` of the least positive recompute cost, costs rounded DOWN.
    Each op then loses less than that fraction of its own cost, so the model's cost of every
    schedule is within `cost_resolution` (relative) below its true cost, whatever share of the
    step the recomputations are: the optimum in units is the true optimum to that precision,
    and the model's bounds are true bounds."""

    byte: int
    exact_rounding: bool
    cost: float
    fused: bool = False  # the problem has values a compiled step fuses into their readers

    @property
    def exact_bytes(self) -> bool:
        """Whether a model that holds every recomputed copy as a buffer counts the
        simulator's bytes."""
        return self.exact_rounding and not self.fused

    @staticmethod
    def of(problem: Problem, options: SolverOptions) -> "Units":
        amounts = [a for op in problem.ops for a in (op.size, op.temp) if a]
        unit = math.gcd(*amounts) if amounts else 1
        total = sum(amounts)
        exact = total // unit <= MAX_UNITS
        if not exact:
            unit = -(-total // MAX_UNITS)
        costs = [problem.ops[v].cost for v in problem.candidates if problem.ops[v].cost > 0]
        cost = options.cost_resolution * min(costs, default=1.0)
        cost = max(cost, sum(costs) / MAX_COST_UNITS)
        return Units(byte=max(unit, 1), exact_rounding=exact, cost=cost if cost > 0 else 1.0,
                     fused=bool(problem.fused_recomputations))

    def bytes_up(self, n: int) -> int:
        return -(-n // self.byte)

    def sizes(self, problem: Problem) -> tuple[list[int], list[int]]:
        """Every op's size and temp bytes, in units (rounded up)."""
        return ([self.bytes_up(op.size) for op in problem.ops],
                [self.bytes_up(op.temp) for op in problem.ops])

    def capacity(self, budget: int) -> int:
        return budget // self.byte

    def cost_of(self, seconds: float) -> int:
        """Rounded down: the model never charges more than the true cost. (A positive cost is at
        least one unit unless MAX_COST_UNITS made the unit coarser than it.)"""
        return max(0, math.floor(seconds / self.cost))


def memory_chain(m: cp_model.CpModel, events: dict, temp_at: dict, fixed, slots: int,
                 total: int, peak, tick) -> list:
    """The memory chain both slot models build (the just-in-time model and the eager one):
    decided[t] = decided[t-1] + the decisions' events at slot t (a new variable only where
    some event moves it), and at each slot where the memory can rise (an event, a temporary,
    the first slot, the fixed bytes growing), decided + fixed + the slot's temporaries <= peak;
    a slot where nothing rises is bounded by the one before it. `tick` is called once a slot
    (the deadline's). Returns decided, slot by slot."""
    decided, level = [], 0
    for t in range(slots):
        tick()
        change = events.get(t)
        if change:
            current = m.NewIntVar(0, total, f"decided[{t}]")
            m.Add(current == level + sum(c * x for c, x in change))
            level = current
        decided.append(level)
        if change or t in temp_at or t == 0 or fixed[t] > fixed[t - 1]:
            m.Add(level + fixed[t] + sum(c * x for c, x in temp_at.get(t, ())) <= peak)
    return decided


def provide_what_is_needed(m: cp_model.CpModel, problem: Problem, candidates, direct,
                           save: dict, rec: dict, readers) -> None:
    """What the backward needs is saved or recomputed, once; nothing else is. A candidate read
    by a backward op directly is needed; another is needed exactly when a recomputed reader
    needs it (make_schedule derives the saved set the same way: needed minus recomputed)."""
    for v in candidates:
        held = [x for x in (save.get(v), rec.get(v)) if x is not None]
        users = [rec[r] for r in readers[v] if r in rec]
        if v in direct:
            if not held:
                raise ValueError(f"{problem.ops[v].name!r} is a tuple op read by the backward "
                                 "and may not be recomputed; no schedule can provide it")
            m.AddExactlyOne(held)
            continue
        if held:
            # Once at most: a value both saved and recomputed is not a schedule, and the
            # just-in-time rule would read "saved" as leave to recompute it late.
            m.AddAtMostOne(held)
            m.Add(sum(held) <= sum(users))
        for u in users:
            if not held:
                m.Add(u == 0)
            else:
                m.AddBoolOr(held).OnlyEnforceIf(u)


def in_model_space(problem: Problem, schedule: Schedule, modelled) -> Schedule | None:
    """`schedule` as a model with a recomputation variable for each value of `modelled` can
    hint it in full: its recomputations of zero-byte tensors (which no model has: saving one
    holds nothing) saved instead, and what only they needed (their inputs, a tuple op whose
    getitems they are) dropped. The cost is no higher (a real graph's zero-byte tensors are
    views, of no cost), nor the peak (the inputs they needed die no later). None where another
    recomputation is outside `modelled`. The relaxation's plans recompute such views freely
    (mamba at 60 %: 17 of them); hinted as they were, the models had no value for them and
    dropped the whole hint."""
    recomputing = schedule.recomputed | schedule.again.keys()
    outside = recomputing - set(modelled)
    if not outside:
        return schedule
    ops = problem.ops
    views = {v for v in outside if ops[v].kind is Kind.TENSOR and not ops[v].size}
    kept = drop_unneeded(problem, schedule.recomputed - views)
    again = {v: ps for v, ps in schedule.again.items() if v not in views}
    if not (kept | again.keys()) <= set(modelled):
        return None
    try:
        return make_schedule(problem, kept, strategy=schedule.strategy, budget=schedule.budget,
                             recompute_at={v: schedule.recompute_at[v] for v in kept},
                             again=again, offload_at=schedule.offload_at)
    except ValueError:  # positions a drop made invalid: then no hint beats a wrong one
        return None


class Axis:
    """The free model's time axis (integers). Forward op i runs at time i. Backward op b owns a
    block of nf + 1 slots starting at base(b) = nf + (b - nf) * (nf + 1): a recomputation of
    forward op v placed before b runs at base(b) + v, and b itself at base(b) + nf. Several
    recomputations placed before one op therefore run in forward order, exactly as
    `simulate.step_order` runs them. The horizon is O(n * nf) numerically, but the slots nobody
    uses cost nothing: live ranges start and end on steps, so the memory at an empty slot never
    exceeds the memory at the next step."""

    def __init__(self, problem: Problem):
        self.nf = problem.num_forward
        self.width = self.nf + 1
        self.end = self.op(len(problem) - 1) if len(problem) else 0

    def op(self, i: int) -> int:
        return i if i < self.nf else self.base(i) + self.nf

    def base(self, b: int) -> int:
        return self.nf + (b - self.nf) * self.width


class Profile:
    """The bytes no decision changes, on a model's time axis: `hold` them, then `add_to` the
    cumulative's intervals as constant segments (returns their highest level)."""

    def __init__(self):
        self.delta: dict[int, int] = {}

    def hold(self, amount: int, first: int, last: int) -> None:
        if amount:
            self.delta[first] = self.delta.get(first, 0) + amount
            self.delta[last + 1] = self.delta.get(last + 1, 0) - amount

    def add_to(self, m: cp_model.CpModel, intervals: list, demands: list) -> int:
        level, peak, points = 0, 0, sorted(self.delta)
        for t, nxt in zip(points, points[1:]):
            level += self.delta[t]
            peak = max(peak, level)
            if level:
                intervals.append(m.NewFixedSizeIntervalVar(t, nxt - t, f"fixed[{t}]"))
                demands.append(level)
        return peak

    def levels(self, slots: int) -> list[int]:
        """The bytes held at each of the first `slots` steps."""
        level, out = 0, []
        for t in range(slots):
            level += self.delta.get(t, 0)
            out.append(level)
        return out
