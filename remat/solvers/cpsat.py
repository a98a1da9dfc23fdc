"""Strategy `optimal`: the exact CP-SAT model of the execution model in `simulate`.

Decisions, per candidate forward storage v (views are never candidates): `save[v]`, `rec[v]`
and, for a recomputation, `pos[v]`, the backward op it is placed before. Everything else of the
step is fixed, so the model stays O(n) in variables.

The time axis (integers): forward op i runs at time i. Backward op b owns a block of nf + 1
slots starting at base(b) = nf + (b - nf) * (nf + 1): a recomputation of forward op v placed
before b runs at base(b) + v, and b itself at base(b) + nf. Several recomputations placed before
one op therefore run in forward order, exactly as `simulate.step_order` runs them. The horizon is
O(n * nf) numerically, but the slots nobody uses cost nothing: live ranges start and end on
steps, so the memory at an empty slot never exceeds the memory at the next step, and one
cumulative constraint over the whole axis checks exactly the steps' memory.

Exactness: with tight live-range ends, the cumulative profile at every step equals `simulate`'s
live bytes. Ends are only bounded below (end >= each active reader's time); looser ends can only
overstate memory, so the least cost is exact, and the second, least-peak stage makes the ends
tight where it matters: its proven peak equals simulate's peak of the returned schedule (checked
in the tests through `info["model_peak"]`). The schedule is built with `make_schedule` from the
solver's positions and evaluated, so the reported peak is always simulate's.
"""
from __future__ import annotations

import bisect
import logging
import math
import time
from dataclasses import dataclass
from types import MappingProxyType

from ortools.sat.python import cp_model

from remat.errors import BudgetError, SolverError
from remat.solvers.bound import Bound, peak_bound, recompute_bound
from remat.solvers.options import SolverOptions
from remat.solvers.problem import Kind, Problem, recompute_blocker, tuple_of
from remat.solvers.registry import STRATEGIES, Strategy, register
from remat.solvers.schedule import Schedule, Status, drop_unneeded, evaluate, make_schedule
from remat.solvers.simulate import simulate

logger = logging.getLogger(__name__)

# Sizes are counted in integer units; beyond this many units in all, the unit grows (see _Units).
MAX_UNITS = 2 ** 40
# Nonzeros the redundant knapsack cuts may add in all.
MAX_CUT_TERMS = 400_000
# The share of the time limit the drop pass may spend improving the hint before the search.
HINT_SHARE = 0.1
# The share of the time limit the least-peak search may spend when no baseline fits the budget.
LEAST_PEAK_SHARE = 0.3
# The share of the time limit for the bound proven from backward steps (remat.solvers.bound):
# a second or two on real graphs, where CP-SAT's own bound stays near zero.
BOUND_SHARE = 0.1
BASELINES = (Strategy.SAVE_ALL, Strategy.CHECKPOINT_BLOCKS, Strategy.CHEN_SQRT, Strategy.GREEDY,
             Strategy.SELECTIVE)


@dataclass(frozen=True)
class _Units:
    """How bytes and seconds become the integers CP-SAT needs.

    Bytes: the unit is the gcd of every size and temp in the problem, so that the counts are
    exact (real problems: sizes share a factor of 2**k; tests: unit 1 or the gcd). Only when the
    total would exceed MAX_UNITS units does the unit grow to total / MAX_UNITS; then sizes are
    rounded UP and the capacity DOWN, so every schedule the model accepts truly fits (the model
    turns conservative by less than one unit per live storage, and says so in info["exact"]).

    Cost: `options.cost_resolution` of the step's total cost, costs rounded to the nearest
    unit (a positive cost to one unit at least); the optimum is exact in those units, and
    within (recomputed ops) * unit of the true least cost otherwise."""

    byte: int
    exact_bytes: bool
    cost: float

    @staticmethod
    def of(problem: Problem, options: SolverOptions) -> "_Units":
        amounts = [a for op in problem.ops for a in (op.size, op.temp) if a]
        unit = math.gcd(*amounts) if amounts else 1
        total = sum(amounts)
        exact = total // unit <= MAX_UNITS
        if not exact:
            unit = -(-total // MAX_UNITS)
        cost = options.cost_resolution * problem.total_cost
        return _Units(byte=max(unit, 1), exact_bytes=exact, cost=cost if cost > 0 else 1.0)

    def bytes_up(self, n: int) -> int:
        return -(-n // self.byte)

    def capacity(self, budget: int) -> int:
        return budget // self.byte

    def cost_of(self, seconds: float) -> int:
        # An op that costs anything costs at least one unit: rounded to zero, the model would
        # recompute it for free and its optimum would drift from the true one.
        units = round(seconds / self.cost)
        return max(units, 1) if seconds > 0 else 0


def _provide_what_is_needed(m: cp_model.CpModel, problem: Problem, candidates, direct,
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


class _Axis:
    """The time axis of the module docstring."""

    def __init__(self, problem: Problem):
        self.nf = problem.num_forward
        self.width = self.nf + 1
        self.end = self.op(len(problem) - 1) if len(problem) else 0

    def op(self, i: int) -> int:
        return i if i < self.nf else self.base(i) + self.nf

    def base(self, b: int) -> int:
        return self.nf + (b - self.nf) * self.width


class _FreeModel:
    """The CP-SAT model with free recompute positions (`SolverOptions.free_positions`), without
    capacity or objective (the stages add those)."""

    def __init__(self, problem: Problem, units: _Units):
        self.problem, self.units = problem, units
        ops, nf = problem.ops, problem.num_forward
        axis = self.axis = _Axis(problem)
        readers = self.readers = problem.storage_readers
        pinned = problem.pinned
        m = self.model = cp_model.CpModel()
        size = [units.bytes_up(op.size) for op in ops]
        temp = [units.bytes_up(op.temp) for op in ops]
        candidates = [v for v in problem.candidates if v not in pinned]

        # --- Presolve: which candidates may be recomputed, and where at the latest.
        # A zero-byte tensor is never worth recomputing: saving it holds nothing, costs nothing
        # and needs none of its inputs. Tuple ops come back only with a getitem that needs them.
        # latest[v]: the last backward op a recomputation of v could precede (its first direct
        # backward reader, else the loosest of its recomputable readers); absent: nothing could
        # need it.
        latest: dict[int, int] = {}
        for v in reversed(candidates):
            if recompute_blocker(problem, v) is not None:
                continue
            if ops[v].kind is Kind.TENSOR and ops[v].size == 0:
                continue
            direct_needs = [r for r in readers[v] if r >= nf]
            through = [latest[r] for r in readers[v] if r in latest]
            if direct_needs or through:  # a recomputed reader binds only when it is recomputed
                latest[v] = min(direct_needs) if direct_needs else max(through)
        self.latest = latest
        direct = {v for v in candidates if any(r >= nf for r in readers[v])}

        # --- Variables.
        self.rec = {v: m.NewBoolVar(f"rec[{v}]") for v in latest}
        self.pos = {v: m.NewIntVar(nf, latest[v], f"pos[{v}]") for v in latest}
        self.save: dict[int, cp_model.IntVar] = {}
        for v in candidates:
            could_need = v in direct or any(r in self.rec for r in readers[v])
            if could_need and ops[v].kind is not Kind.TUPLE:  # a tuple cannot be saved
                self.save[v] = m.NewBoolVar(f"save[{v}]")
        # When recomputed before b, v runs at base(b) + v.
        self.at = {v: axis.width * self.pos[v] + (nf - nf * axis.width + v) for v in latest}

        # --- What the backward needs is saved or recomputed, once; nothing else is.
        # (make_schedule derives the saved set the same way: needed minus recomputed.)
        _provide_what_is_needed(m, problem, candidates, direct, self.save, self.rec, readers)

        # --- Recompute positions: before every recomputed reader (before every backward reader
        # is the domain), and a getitem where its tuple op is (recomputing the tuple makes it).
        for v in latest:
            m.Add(self.pos[v] == latest[v]).OnlyEnforceIf(self.rec[v].Not())  # no symmetry
            for r in readers[v]:
                if r in self.rec:
                    m.Add(self.pos[v] <= self.pos[r]).OnlyEnforceIf([self.rec[v], self.rec[r]])
            t = tuple_of(problem, v)
            if t is not None:
                m.Add(self.pos[v] == self.pos[t]).OnlyEnforceIf(self.rec[v])

        # --- Live ranges of the decided storages (optional intervals), memory per unit.
        intervals, demands = [], []
        self.save_end: dict[int, cp_model.IntVar] = {}
        self.rec_end: dict[int, cp_model.IntVar] = {}
        self.rec_length: dict[int, cp_model.IntVar] = {}
        self.end_low: dict[int, int] = {}
        for v in candidates:
            last_fwd = max((r for r in readers[v] if r < nf), default=v)
            last_bwd = max((axis.op(r) for r in readers[v] if r >= nf), default=None)
            later = [r for r in readers[v] if r in self.rec]
            if v in self.save and size[v]:
                # The saved copy: beyond its last forward reader, to its last backward reader.
                start = last_fwd + 1
                low = max(start, last_bwd if last_bwd is not None else nf)
                end = self.save_end[v] = m.NewIntVar(low, axis.end, f"save_end[{v}]")
                self.end_low[end.Index()] = low
                for r in later:
                    m.Add(end >= self.at[r]).OnlyEnforceIf(self.rec[r])
                intervals.append(m.NewOptionalIntervalVar(start, end + 1 - start, end + 1,
                                                          self.save[v], f"saved[{v}]"))
                demands.append(size[v])
            if v in self.rec and size[v]:
                # The recomputed copy: from its recomputation to its last backward reader.
                low = last_bwd if last_bwd is not None else nf
                end = self.rec_end[v] = m.NewIntVar(low, axis.end, f"rec_end[{v}]")
                self.end_low[end.Index()] = low
                m.Add(end >= self.at[v])
                for r in later:
                    m.Add(end >= self.at[r]).OnlyEnforceIf(self.rec[r])
                # A getitem's copy exists from the step after its tuple op's recomputation
                # (simulate's rule): pos[v] == pos[t] makes that at[v] - (v - t) + 1.
                t = tuple_of(problem, v)
                start = self.at[v] if t is None else self.at[v] + (t + 1 - v)
                length = self.rec_length[v] = m.NewIntVar(1, axis.end + 1, f"rec_length[{v}]")
                intervals.append(m.NewOptionalIntervalVar(start, length, end + 1,
                                                          self.rec[v], f"again[{v}]"))
                demands.append(size[v])
            if v in self.rec and temp[v]:
                intervals.append(m.NewOptionalFixedSizeIntervalVar(self.at[v], 1, self.rec[v],
                                                                   f"temp[{v}]"))
                demands.append(temp[v])

        # --- Everything else is fixed: one profile, added as constant segments.
        delta: dict[int, int] = {}

        def hold(amount: int, first: int, last: int) -> None:
            if amount:
                delta[first] = delta.get(first, 0) + amount
                delta[last + 1] = delta.get(last + 1, 0) - amount

        for i, op in enumerate(ops):
            hold(temp[i], axis.op(i), axis.op(i))
            if problem.root[i] != i:
                continue
            t = tuple_of(problem, i)
            made = axis.op(i) if t is None else axis.op(t) + 1  # simulate's rule for getitems
            if i in pinned:
                hold(size[i], made, axis.end)
            elif i >= nf:
                hold(size[i], made, max((axis.op(r) for r in readers[i]), default=axis.op(i)))
            else:  # the forward life every forward storage has, whatever is decided
                hold(size[i], made, max((r for r in readers[i] if r < nf), default=i))
        level, self.fixed_peak, points = 0, 0, sorted(delta)
        for t, nxt in zip(points, points[1:]):
            level += delta[t]
            self.fixed_peak = max(self.fixed_peak, level)
            if level:
                intervals.append(m.NewFixedSizeIntervalVar(t, nxt - t, f"fixed[{t}]"))
                demands.append(level)

        # --- One cumulative constraint: the memory of every step is at most the peak.
        self.peak = m.NewIntVar(self.fixed_peak, max(sum(demands), self.fixed_peak), "peak")
        m.AddCumulative(intervals, demands, self.peak)

        # --- Redundant knapsacks at backward steps, for the LP bound: the cumulative alone
        # relaxes poorly with optional intervals of variable start. At backward op b, a saved
        # copy is live if b comes before its last backward reader; a recomputed one too if
        # its latest position is already behind. Both are lower bounds of the exact profile.
        level_at = self._levels(delta)
        window = []
        for v in candidates:
            last = max((r for r in readers[v] if r >= nf), default=None)
            if last is None or not size[v]:
                continue
            if v in self.save:
                window.append((nf, last, size[v], self.save[v]))
            if v in self.rec and latest[v] <= last:
                window.append((latest[v], last, size[v], self.rec[v]))
        for b in self._cut_points(problem, window, level_at):
            terms = [(c, x) for lo, hi, c, x in window if lo <= b <= hi]
            if terms:
                m.Add(sum(c * x for c, x in terms) + level_at(axis.op(b)) <= self.peak)
        # The last forward step: every saved storage past its last forward reader is live.
        boundary = [(size[v], self.save[v]) for v in candidates if v in self.save and size[v]
                    and max((r for r in readers[v] if r < nf), default=v) < nf - 1]
        if boundary and nf:
            m.Add(sum(c * x for c, x in boundary) + level_at(nf - 1) <= self.peak)

        self.cost = cp_model.LinearExpr.WeightedSum(
            list(self.rec.values()), [units.cost_of(ops[v].cost) for v in self.rec])

    @staticmethod
    def _levels(delta: dict[int, int]):
        points = sorted(delta)
        levels, level = [], 0
        for t in points:
            level += delta[t]
            levels.append(level)

        def level_at(t: int) -> int:
            k = bisect.bisect_right(points, t) - 1
            return levels[k] if k >= 0 else 0
        return level_at

    def _cut_points(self, problem: Problem, window, level_at) -> list[int]:
        """The backward ops to cut at: all of them while the cuts stay small (MAX_CUT_TERMS
        nonzeros, counted per cut), else those where saving everything would hold the most,
        plus an even spread, as many as fit."""
        backward = list(problem.backward)
        if not window or not backward:
            return []
        cover = [0] * (len(problem) + 1)
        count = [0] * (len(problem) + 1)
        for lo, hi, c, _ in window:
            cover[lo] += c
            cover[hi + 1] -= c
            count[lo] += 1
            count[hi + 1] -= 1
        held, terms, running, active = {}, {}, 0, 0
        for b in range(len(problem)):
            running += cover[b]
            active += count[b]
            if b >= problem.num_forward:
                held[b] = running + level_at(self.axis.op(b))
                terms[b] = active
        if sum(terms.values()) <= MAX_CUT_TERMS:
            return backward
        chosen, used = set(), 0
        spread = backward[:: max(1, len(backward) // 64)]
        by_pressure = sorted(backward, key=lambda b: -held[b])
        for b in [x for pair in zip(by_pressure, spread + by_pressure) for x in pair]:
            if b in chosen or used + terms[b] > MAX_CUT_TERMS:
                continue
            chosen.add(b)
            used += terms[b]
        return sorted(chosen)

    # --- Reading and hinting solutions.

    def decision(self, value) -> tuple[set[int], dict[int, int]]:
        recomputed = {v for v, x in self.rec.items() if value(x)}
        return recomputed, {v: int(value(self.pos[v])) for v in recomputed}

    def hint(self, schedule: Schedule) -> None:
        """Hint every decision variable from `schedule` (a baseline's, or an earlier stage's)."""
        m = self.model
        m.ClearHints()
        recomputed = schedule.recomputed
        if not recomputed <= self.rec.keys():
            return  # not a schedule of this model's space (a zero-byte recomputation, say)
        at = {v: self.axis.base(b) + v for v, b in schedule.recompute_at.items()}
        for v, x in self.rec.items():
            m.AddHint(x, v in recomputed)
            m.AddHint(self.pos[v], schedule.recompute_at.get(v, self.latest[v]))
        for v, x in self.save.items():
            m.AddHint(x, v in schedule.saved)
        # A complete hint: CP-SAT then starts from it as a solution (a partial one it must
        # complete by search, which at 10,000 ops found nothing within a minute).
        start = {v: self.axis.base(schedule.recompute_at.get(v, self.latest[v])) + v
                 for v in self.rec}
        for ends, alive in ((self.save_end, schedule.saved), (self.rec_end, recomputed)):
            for v, end in ends.items():
                times = [self.axis.op(r) for r in self.readers[v] if r >= self.axis.nf]
                times += [at[r] for r in self.readers[v] if r in at]
                if ends is self.rec_end:
                    times.append(start[v])
                value = min(max(times + [self.end_low[end.Index()]]), self.axis.end)
                m.AddHint(end, value)
                if ends is self.rec_end:
                    t = tuple_of(self.problem, v)
                    made = start[v] if t is None else start[v] + (t + 1 - v)  # as the interval
                    m.AddHint(self.rec_length[v], max(1, value + 1 - made))
        m.AddHint(self.peak, max(self.units.bytes_up(schedule.peak), self.fixed_peak))


class _JitModel:
    """The CP-SAT model with just-in-time positions (the default; DESIGN.md's rule).

    A recomputation of v runs before pos[v] = min(its first direct backward reader, pos[w] of
    every recomputed reader w): a function of the recomputed set, so the decisions are the
    booleans alone. Positions are encoded by order literals le[v, p] = "v is recomputed at or
    before backward op p" over the few positions p the rule can produce (P(v), computed by a
    reverse sweep), which keeps the LP relaxation tight.

    Time is a sparse axis of slots: every forward op; then per backward op b, one sub-slot per
    value that may be recomputed before b (in forward order, as `simulate` runs them), then b.
    Memory is not a cumulative: the decided bytes live at slot t, D[t], follow a chain
    D[t] = D[t-1] + (what starts at t) - (what ended at t-1), each copy contributing two events,
    so the model stays O(slots + sum |P(v)|) in size while its LP equals a knapsack at every
    slot. A sub-slot nobody uses needs no enforcement switch: every live range starts and ends on
    a step that runs, so the live set at an empty slot is a subset of the next step's.

    Exactness: D[t] is exact for the order literals of a decision; the held-until literals
    Hge[v, j] ("v is held, and its last reader runs at or after candidate end j") are only bounded
    below, which can only overstate memory, so the least cost is exact and the least-peak stage
    makes them tight where the peak is (info["model_peak"] equals simulate's peak)."""

    def __init__(self, problem: Problem, units: _Units):
        self.problem, self.units = problem, units
        ops, nf = problem.ops, problem.num_forward
        readers = self.readers = problem.storage_readers
        pinned = problem.pinned
        m = self.model = cp_model.CpModel()
        size = [units.bytes_up(op.size) for op in ops]
        temp = [units.bytes_up(op.temp) for op in ops]
        candidates = [v for v in problem.candidates if v not in pinned]

        # --- Step 1, presolve: which candidates may be recomputed (as in _FreeModel), and the
        # positions P(v) the just-in-time rule can give them. first_direct[v]: v's first direct
        # backward reader. A tuple op goes where its first recomputed getitem would; its
        # getitems go with it.
        first_direct = {v: min((r for r in readers[v] if r >= nf), default=None) for v in candidates}
        self.first_direct = first_direct
        may: set[int] = set()
        for v in reversed(candidates):
            if recompute_blocker(problem, v) is not None:
                continue
            if ops[v].kind is Kind.TENSOR and ops[v].size == 0:
                continue
            if first_direct[v] is not None or any(r in may for r in readers[v]):
                may.add(v)
        jit_positions: dict[int, list[int]] = {}  # a getitem's own rule, before its tuple's
        positions: dict[int, list[int]] = {}
        for v in sorted(may, reverse=True):
            if ops[v].kind is Kind.TUPLE:
                getitems = [g for g in problem.users[v] if g in may]
                positions[v] = sorted(set().union(*(jit_positions[g] for g in getitems)))
                for g in getitems:
                    positions[g] = [p for p in positions[v] if p <= jit_positions[g][-1]]
                continue
            d = first_direct[v]
            found = {d} if d is not None else set()
            for w in readers[v]:
                if w in may:
                    found.update(p for p in positions[w] if d is None or p <= d)
            own = sorted(found)
            if tuple_of(problem, v) is not None:
                jit_positions[v] = own
            positions[v] = own
        self.positions = positions
        self.may = may

        # --- Step 2, decision variables: rec, save, and the position order literals.
        self.rec = {v: m.NewBoolVar(f"rec[{v}]") for v in sorted(may)}
        self.save: dict[int, cp_model.IntVar] = {}
        direct = {v for v in candidates if first_direct[v] is not None}
        for v in candidates:
            could_need = v in direct or any(r in self.rec for r in readers[v])
            if could_need and ops[v].kind is not Kind.TUPLE:  # a tuple cannot be saved
                self.save[v] = m.NewBoolVar(f"save[{v}]")

        def order_literals(v: int, allowed: list[int], name: str) -> dict[int, object]:
            literals = {p: m.NewBoolVar(f"{name}[{v},{p}]") for p in allowed[:-1]}
            literals[allowed[-1]] = self.rec[v]
            for p, q in zip(allowed, allowed[1:]):
                m.AddImplication(literals[p], literals[q])
            return literals

        self.le = {v: order_literals(v, positions[v], "le") for v in self.rec}
        self.jit_le = {g: order_literals(g, jit_positions[g], "jit_le")
                       for g in self.rec if g in jit_positions}

        def le_at(literals: dict, p: int):
            """The literal "at or before p", from the largest allowed position <= p."""
            below = [q for q in literals if q <= p]
            return literals[max(below)] if below else None

        # --- Step 3, what the backward needs is saved or recomputed, once; nothing else is.
        _provide_what_is_needed(m, problem, candidates, direct, self.save, self.rec, readers)

        # --- Step 4, the just-in-time rule on the order literals. v is recomputed at or before
        # p iff it is recomputed and (its first direct reader is at or before p, or a recomputed
        # reader is). A recomputed reader forces v held, so "v not saved" means "v recomputed":
        # le[v,p] + save[v] >= le[w,p], which is tighter in the LP than the conjunction.
        def jit(v: int, literals: dict) -> None:
            d = first_direct[v]
            keep = self.save.get(v)
            for p, lit in literals.items():
                if d is not None and p >= d:
                    continue  # the direct reader binds: lit is rec[v] (the last position)
                if lit is self.rec[v] and d is None:
                    continue  # "recomputed at all" is step 3's business
                ups = []
                for w in readers[v]:
                    if w in self.rec:
                        wl = le_at(self.le[w], p)
                        if wl is not None:
                            ups.append(wl)
                            m.Add(lit + (keep if keep is not None else 0) >= wl)
                m.Add(lit <= sum(ups)) if ups else m.Add(lit == 0)

        for v in self.rec:
            if ops[v].kind is Kind.TUPLE:
                getitems = [g for g in problem.users[v] if g in self.rec]
                for p, lit in self.le[v].items():
                    ups = [x for x in (le_at(self.jit_le[g], p) for g in getitems) if x is not None]
                    for x in ups:
                        m.AddImplication(x, lit)
                    m.Add(lit <= sum(ups)) if ups else m.Add(lit == 0)
            elif v in self.jit_le:
                jit(v, self.jit_le[v])
                t = tuple_of(problem, v)
                for p, lit in self.le[v].items():  # le[g,p] = rec[g] and le[t,p]
                    if lit is self.rec[v]:
                        continue
                    tl = le_at(self.le[t], p)
                    if tl is None:
                        m.Add(lit == 0)
                        continue
                    m.AddImplication(lit, tl)
                    m.AddBoolOr([lit, self.rec[v].Not(), tl.Not()])
            else:
                jit(v, self.le[v])

        # --- Step 5, the slots.
        before: dict[int, list[int]] = {}
        for v, allowed in positions.items():
            for p in allowed:
                before.setdefault(p, []).append(v)
        slot_of: dict[tuple[int, int], int] = {}
        self.op_slot = list(range(nf))
        slots = nf
        for b in problem.backward:
            for v in sorted(before.get(b, ())):
                slot_of[(b, v)] = slots
                slots += 1
            self.op_slot.append(slots)
            slots += 1
        self.slots = slots
        op_slot = self.op_slot

        # --- Step 6, the fixed profile: everything no decision moves.
        fixed = [0] * (slots + 1)

        def hold(amount: int, first: int, last: int) -> None:
            if amount:
                fixed[first] += amount
                fixed[last + 1] -= amount

        for i, op in enumerate(ops):
            hold(temp[i], op_slot[i], op_slot[i])
            if problem.root[i] != i:
                continue
            t = tuple_of(problem, i)
            made = op_slot[i] if t is None else op_slot[t] + 1  # simulate's rule for getitems
            if i in pinned:
                hold(size[i], made, slots - 1)
            elif i >= nf:
                hold(size[i], made, max((op_slot[r] for r in readers[i]), default=op_slot[i]))
            else:
                hold(size[i], made, max((r for r in readers[i] if r < nf), default=i))
        for t in range(1, slots + 1):
            fixed[t] += fixed[t - 1]
        self.fixed = fixed[:slots]
        self.fixed_peak = max(self.fixed, default=0)

        # --- Step 7, the decided bytes as events on the slots. A candidate v of s units
        # contributes, at a forward slot past its last forward reader, s * save[v]; at a
        # backward slot t, s * (H(t) - rec[v] + started(t)), where started(t) says that its
        # recomputation ran at or before t and H(t) that it is held (save + rec) and its last
        # reader runs at t or later. H is held up to its last direct backward reader; past that,
        # the literal hge[v, c] for each later candidate end c (a recomputed reader's slot),
        # bounded below by the readers that would run there. So: +s*save beyond the forward;
        # +s*x[v,p] at each start slot; at each end, H steps down.
        events: dict[int, list[tuple[int, object]]] = {}

        def event(t: int, coef: int, x) -> None:
            if t < slots and coef:
                events.setdefault(t, []).append((coef, x))

        self.hge: dict[int, list[tuple[int, object]]] = {}
        self.direct_end: dict[int, int] = {}
        for v in candidates:
            s = size[v]
            keep, again = self.save.get(v), self.rec.get(v)
            held = [x for x in (keep, again) if x is not None]
            if not s or not held:
                continue
            if keep is not None:
                event(max((r for r in readers[v] if r < nf), default=v) + 1, s, keep)
            if again is not None:
                previous = None
                t = tuple_of(problem, v)
                for p, lit in self.le[v].items():
                    # A getitem's copy exists from the slot after its tuple op's (simulate).
                    made = slot_of[(p, v)] if t is None else slot_of[(p, t)] + 1
                    event(made, s, lit)
                    if previous is not None:
                        event(made, -s, previous)
                    previous = lit
            direct_end = max((op_slot[r] for r in readers[v] if r >= nf), default=None)
            options_at = [(slot_of[(p, w)], w) for w in readers[v] if w in self.rec
                          for p in self.le[w]]
            ends = sorted({t for t, _ in options_at})
            if direct_end is None:
                direct_end = ends[0]  # held means some recomputed reader runs, at ends[0] or later
            self.direct_end[v] = direct_end
            chain = [(t, m.NewBoolVar(f"hge[{v},{t}]")) for t in ends if t > direct_end]
            self.hge[v] = chain
            level_now, end_now = held, direct_end
            for t, lit in chain:
                for x in level_now:
                    event(end_now + 1, -s, x)
                event(end_now + 1, s, lit)
                if level_now is not held:
                    m.AddImplication(lit, level_now[0])
                else:
                    m.Add(lit <= sum(held))
                for w in dict.fromkeys(w for tt, w in options_at if tt >= t):
                    # w recomputed with its slot at t or later: rec[w] - le[w, last slot < t].
                    below = [p for p in self.le[w] if slot_of[(p, w)] < t]
                    if below:
                        m.Add(lit >= self.rec[w] - self.le[w][max(below)])
                    else:
                        m.AddImplication(self.rec[w], lit)
                level_now, end_now = [lit], t
            for x in level_now:
                event(end_now + 1, -s, x)
        self.slot_of = slot_of
        self.events = events

        # --- Step 8, the memory chain: decided[t] = decided[t-1] + events at t, and at each
        # slot decided + fixed + the temp of a recomputation running there <= peak.
        total = sum(size) + sum(temp) + 1
        self.peak = m.NewIntVar(self.fixed_peak, max(total, self.fixed_peak), "peak")
        self.decided: list = []
        temp_at: dict[int, list[tuple[int, object]]] = {}
        for v in self.rec:
            if temp[v]:
                previous = None
                for p, lit in self.le[v].items():
                    terms = [(temp[v], lit)] + ([(-temp[v], previous)] if previous is not None else [])
                    temp_at[slot_of[(p, v)]] = terms
                    previous = lit
        level = 0
        for t in range(slots):
            change = events.get(t)
            if change:
                current = m.NewIntVar(0, total, f"decided[{t}]")
                m.Add(current == level + sum(c * x for c, x in change))
                level = current
            self.decided.append(level)
            if change or t in temp_at or t == 0 or self.fixed[t] > self.fixed[t - 1]:
                extra = temp_at.get(t, [])
                m.Add(level + self.fixed[t] + sum(c * x for c, x in extra) <= self.peak)
        self.temp_at = temp_at
        self.cost = cp_model.LinearExpr.WeightedSum(
            list(self.rec.values()), [units.cost_of(ops[v].cost) for v in self.rec])

    # --- Reading and hinting solutions.

    def decision(self, value) -> tuple[set[int], None]:
        return {v for v, x in self.rec.items() if value(x)}, None

    def hint(self, schedule: Schedule) -> None:
        """Hint every variable from `schedule`, re-placed just in time (a baseline's, or an
        earlier stage's): a complete hint, so that CP-SAT starts from a solution."""
        m = self.model
        m.ClearHints()
        recomputed = set(schedule.recomputed)
        if not recomputed <= self.rec.keys():
            return
        jit = make_schedule(self.problem, recomputed)
        at = dict(jit.recompute_at)
        values: dict[int, int] = {}
        variables: dict[int, object] = {}

        def put(x, value: int) -> None:
            if not isinstance(x, int):
                values[x.Index()] = int(value)
                variables[x.Index()] = x

        for v, x in self.rec.items():
            put(x, v in recomputed)
        for v, x in self.save.items():
            put(x, v in jit.saved)
        for v, literals in self.le.items():
            for p, x in literals.items():
                put(x, v in at and at[v] <= p)
        nf = self.problem.num_forward
        for g, literals in self.jit_le.items():
            own = None
            if g in recomputed:
                needs = [r if r >= nf else at[r] for r in self.readers[g] if r >= nf or r in at]
                own = min(needs)
            for p, x in literals.items():
                put(x, own is not None and own <= p)
        for v, chain in self.hge.items():
            held = v in recomputed or v in jit.saved
            last = [self.slot_of[(at[w], w)] for w in self.readers[v] if w in at]
            end = max(last + [self.direct_end[v]])
            for t, x in chain:
                put(x, held and end >= t)

        def evaluate_expr(terms) -> int:
            return sum(c * (x if isinstance(x, int) else values[x.Index()]) for c, x in terms)

        level = 0
        peak = 0
        for t in range(self.slots):
            x = self.decided[t]
            if not isinstance(x, int) and x.Index() not in values:
                level += evaluate_expr(self.events[t])
                put(x, level)
            peak = max(peak, level + self.fixed[t] + evaluate_expr(self.temp_at.get(t, [])))
        put(self.peak, peak)
        for index, value in values.items():
            m.AddHint(variables[index], value)


class _Trace(cp_model.CpSolverSolutionCallback):
    """The anytime trace: every improving schedule's cost and the bound at that moment."""

    def __init__(self, units: _Units, start: float, user, enough: float = -math.inf):
        super().__init__()
        self.units, self.start, self.user, self.trace = units, start, user, []
        self.enough = enough  # a cost this low is proven optimal elsewhere: stop there

    def on_solution_callback(self) -> None:
        entry = {"time": time.perf_counter() - self.start,
                 "cost": self.ObjectiveValue() * self.units.cost,
                 "bound": self.BestObjectiveBound() * self.units.cost}
        self.trace.append(entry)
        if self.user is not None:
            self.user(entry)
        if entry["cost"] <= self.enough:
            self.StopSearch()


def _solver(options: SolverOptions, seconds: float) -> cp_model.CpSolver:
    solver = cp_model.CpSolver()
    params = solver.parameters
    params.max_time_in_seconds = max(seconds, 0.01)
    if options.workers:
        params.num_workers = options.workers
    params.random_seed = options.seed
    params.relative_gap_limit = options.relative_gap
    # Probing was most of the time outside the search: 4.6 s of a 12.7 s presolve at 5,000 ops
    # (free model), 15-18 s twice at 500 ops (just-in-time model), before any search started.
    params.cp_model_probing_level = 0
    if options.log:
        params.log_search_progress = True
        params.log_to_stdout = False
        solver.log_callback = logger.info
    return solver


def _baselines(problem: Problem, budget: int, options: SolverOptions) -> list[Schedule]:
    from remat.solvers import registry

    found = []
    for strategy in BASELINES:
        if strategy not in STRATEGIES:
            continue
        try:
            found.append(registry.solve(problem, budget, strategy, options))
        except BudgetError:
            continue
    return found


def _best_baseline(problem: Problem, budget: int, options: SolverOptions) -> Schedule | None:
    return min(_baselines(problem, budget, options), key=lambda s: (s.cost, s.peak), default=None)


def _least_peak_baseline(problem: Problem, options: SolverOptions) -> Schedule | None:
    """The baseline schedule of least peak, each baseline at a budget it always meets."""
    unbounded = sum(op.size + op.temp for op in problem.ops)
    return min(_baselines(problem, unbounded, options), key=lambda s: (s.peak, s.cost),
               default=None)


def _drop_pass(problem: Problem, budget: int, hint: Schedule, deadline: float) -> Schedule:
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


def _model(problem: Problem, units: _Units, options: SolverOptions):
    return (_FreeModel if options.free_positions else _JitModel)(problem, units)


def _smallest_peak(problem: Problem, units: _Units, options: SolverOptions,
                   seconds: float) -> tuple[Schedule, bool]:
    """The schedule of least simulated peak (whatever its cost), and whether that is proven."""
    model = _model(problem, units, options)
    model.model.Minimize(model.peak)
    # Started from the baseline of least peak, the search can only improve on it; when the
    # time runs out, that baseline's peak is still a budget that fits.
    baseline = _least_peak_baseline(problem, options)
    if baseline is not None:
        model.hint(baseline)
    solver = _solver(options, seconds)
    status = solver.Solve(model.model)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        if baseline is not None:
            return baseline, False
        raise SolverError(f"optimal: no schedule fits, and the search for the smallest peak "
                          f"stopped ({solver.StatusName(status)}) within {seconds:.1f} s; "
                          "raise time_limit to learn the smallest budget that fits")
    recomputed, positions = model.decision(solver.Value)
    schedule = make_schedule(problem, recomputed, recompute_at=positions, strategy="optimal")
    if baseline is not None and baseline.peak < schedule.peak:
        return baseline, False
    return schedule, status == cp_model.OPTIMAL and units.exact_bytes


def _best_bound(searched: float, steps: Bound, problem: Problem, info: dict) -> float:
    """The higher of CP-SAT's bound and the one proven from backward steps; `info["bound_from"]`
    says which, for the report."""
    if steps.steps and steps.value > searched:
        info["bound_from"] = f"backward steps ({steps.where(problem)})"
        return steps.value
    info["bound_from"] = "CP-SAT search"
    return searched


@register(Strategy.OPTIMAL)
def optimal(problem: Problem, budget: int, options: SolverOptions) -> Schedule:
    """The least-recompute-cost schedule whose simulated peak fits `budget`, least peak among
    equals; OPTIMAL when proven, else FEASIBLE with the best bound (time limit, relative gap)."""
    start = time.perf_counter()
    units = _Units.of(problem, options)
    model = _model(problem, units, options)
    info = {"byte_unit": units.byte, "cost_unit": units.cost, "exact": units.exact_bytes,
            "variables": len(model.model.Proto().variables)}
    m = model.model

    def left() -> float:
        return options.time_limit - (time.perf_counter() - start)

    def too_small(smallest: Schedule, proven: bool) -> BudgetError:
        words = ""
        if not proven:
            floor = peak_bound(problem, time_limit=BOUND_SHARE * options.time_limit,
                               workers=options.workers)
            proven = floor.value >= smallest.peak
            words = "" if proven else (f" (the least found within the time limit; no schedule "
                                       f"peaks below {math.ceil(floor.value):,}, proven)")
        return BudgetError(
            f"no schedule fits a budget of {budget:,} bytes: the smallest activation peak any "
            f"schedule reaches is {smallest.peak:,} bytes{words}; recomputation cannot go lower. "
            "Raise the budget or shrink what the backward must hold (smaller batch, sequence)",
            budget=budget, smallest=smallest.peak,
            schedule=evaluate(problem, smallest, strategy=Strategy.OPTIMAL.value))

    def fail() -> Schedule:
        """Where the model finds nothing that fits: the least-peak schedule, which fits only
        where rounding made the model conservative; else BudgetError."""
        smallest, proven = _smallest_peak(problem, units, options, max(left(), 1.0))
        if smallest.peak > budget:
            raise too_small(smallest, proven)
        return evaluate(problem, smallest, status=Status.FEASIBLE, budget=budget, bound=0.0,
                        solve_time=time.perf_counter() - start, info=info)

    # --- Stage 1: least recompute cost under the capacity (budget rounded DOWN to units).
    capacity = units.capacity(budget)
    if model.fixed_peak > capacity:
        return fail()
    m.Add(model.peak <= capacity)
    m.Minimize(model.cost)
    hint = options.hint or _best_baseline(problem, budget, options)
    if hint is None or hint.peak > budget:
        # Near the smallest peak no baseline fits, and CP-SAT rarely finds a first schedule on
        # its own there; the least-peak search does (or proves that none fits), and its
        # schedule, where it fits, is the start.
        least, proven = _smallest_peak(problem, units, options, LEAST_PEAK_SHARE * left())
        if least.peak <= budget:
            hint = least
        elif proven:
            raise too_small(least, proven)
    if hint is not None:
        hint = _drop_pass(problem, budget, hint,
                          time.perf_counter() + HINT_SHARE * options.time_limit)
        model.hint(hint)
        info["hint"] = hint.strategy
    # Where the hint peaks is where the budget binds: a good step to prove a bound at.
    peak_step = simulate(problem, hint).peak_step if hint is not None else None
    step_bound = recompute_bound(problem, budget, time_limit=BOUND_SHARE * options.time_limit,
                                 workers=options.workers,
                                 steps=[peak_step.op] if peak_step is not None else [])
    if step_bound.value == math.inf:  # no schedule fits: find the least peak for the error
        return fail()
    # The model's costs are rounded to units, each at most half a unit off the real one; its
    # OPTIMAL means optimal within a unit per value (see _Units), and so does meeting the bound.
    resolution = len(problem.candidates) * units.cost
    if step_bound.steps:
        info.update(step_bound=step_bound.value, step_bound_at=step_bound.where(problem))
        # Told the bound, CP-SAT's own bound starts there, and the search stops once a plan
        # reaches it as closely as the rounding lets the model tell.
        m.Add(model.cost >= max(0, math.floor((step_bound.value - resolution / 2) / units.cost)))
    trace = _Trace(units, start, options.on_solution, enough=step_bound.value + resolution / 2)
    solver = _solver(options, left())
    status = solver.Solve(m, trace)
    if status == cp_model.INFEASIBLE:
        return fail()
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE) and hint is not None \
            and hint.peak <= budget:  # a caller's hint need not fit
        # The search ran out of time before it accepted any schedule, but the hint is one that
        # fits (simulated): return it as what the search has, with the bound it proved.
        logger.warning("optimal: CP-SAT found no schedule within %.1f s; returning the hint "
                       "(%s, improved by the drop pass), FEASIBLE", options.time_limit,
                       hint.strategy)
        info.update(stage1_time=solver.WallTime(), trace=trace.trace, from_hint=True)
        bound = solver.BestObjectiveBound() * units.cost
        bound = _best_bound(bound if math.isfinite(bound) else 0.0, step_bound, problem, info)
        return evaluate(problem, hint, strategy=Strategy.OPTIMAL.value, status=Status.FEASIBLE,
                        budget=budget, bound=bound,
                        solve_time=time.perf_counter() - start, info=MappingProxyType(info))
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        tried = (f"hinted with {hint.strategy}, which does not fit" if hint is not None
                 else "no baseline fits to hint")
        raise SolverError(f"optimal: no schedule within the time limit of {options.time_limit} s "
                          f"(CP-SAT {solver.StatusName(status)}; {tried}; "
                          f"{info['variables']} variables); raise time_limit or the budget")
    optimum = status == cp_model.OPTIMAL
    best_cost = round(solver.ObjectiveValue())
    bound = _best_bound(solver.BestObjectiveBound() * units.cost, step_bound, problem, info)
    recomputed, positions = model.decision(solver.Value)
    model_peak = solver.Value(model.peak)
    info.update(stage1_time=solver.WallTime(), trace=trace.trace)

    # --- Stage 2: least peak at that cost (keeps the live-range ends tight, too).
    if left() > 0.05:
        first = make_schedule(problem, recomputed, recompute_at=positions)
        m.Add(model.cost <= best_cost)
        m.Minimize(model.peak)
        model.hint(first)
        solver = _solver(options, left())
        status2 = solver.Solve(m)
        if status2 in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            recomputed, positions = model.decision(solver.Value)
            model_peak = solver.Value(model.peak)
            info["peak_proven"] = status2 == cp_model.OPTIMAL
    info["model_peak"] = model_peak * units.byte

    schedule = make_schedule(problem, recomputed, recompute_at=positions)
    optimum = optimum or schedule.cost <= step_bound.value + resolution
    return evaluate(problem, schedule, strategy=Strategy.OPTIMAL.value,
                    status=Status.OPTIMAL if optimum else Status.FEASIBLE, budget=budget,
                    bound=bound, solve_time=time.perf_counter() - start,
                    info=MappingProxyType(info))
