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
from dataclasses import dataclass, replace
from types import MappingProxyType

from ortools.sat.python import cp_model

from remat.errors import BudgetError, SolverError
from remat.solvers.options import SolverOptions
from remat.solvers.problem import Kind, Problem, recompute_blocker, tuple_of
from remat.solvers.registry import STRATEGIES, Strategy, register
from remat.solvers.schedule import (Schedule, Status, evaluate, make_schedule, pinned_storages,
                                    storage_readers)

logger = logging.getLogger(__name__)

# Sizes are counted in integer units; beyond this many units in all, the unit grows (see _Units).
MAX_UNITS = 2 ** 40
# Nonzeros the redundant knapsack cuts may add in all.
MAX_CUT_TERMS = 400_000
BASELINES = (Strategy.SAVE_ALL, Strategy.CHECKPOINT_BLOCKS, Strategy.CHEN_SQRT, Strategy.GREEDY)


@dataclass(frozen=True)
class _Units:
    """How bytes and seconds become the integers CP-SAT needs.

    Bytes: the unit is the gcd of every size and temp in the problem, so that the counts are
    exact (real problems: sizes share a factor of 2**k; tests: unit 1 or the gcd). Only when the
    total would exceed MAX_UNITS units does the unit grow to total / MAX_UNITS; then sizes are
    rounded UP and the capacity DOWN, so every schedule the model accepts truly fits (the model
    turns conservative by less than one unit per live storage, and says so in info["exact"]).

    Cost: `options.cost_resolution` of the step's total cost, sizes rounded to the nearest
    unit; the optimum is exact in those units, and within (recomputed ops) * unit / 2 of the
    true least cost otherwise."""

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
        return round(seconds / self.cost)


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


class _Model:
    """The CP-SAT model of one problem, without capacity or objective (the stages add those)."""

    def __init__(self, problem: Problem, units: _Units):
        self.problem, self.units = problem, units
        ops, nf = problem.ops, problem.num_forward
        axis = self.axis = _Axis(problem)
        readers = self.readers = storage_readers(problem)
        pinned = pinned_storages(problem)
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
        for v in candidates:
            held = [x for x in (self.save.get(v), self.rec.get(v)) if x is not None]
            users = [self.rec[r] for r in readers[v] if r in self.rec]
            if v in direct:
                if not held:
                    raise ValueError(f"{ops[v].name!r} is a tuple op read by the backward and "
                                     "may not be recomputed; no schedule can provide it")
                m.AddExactlyOne(held)
                continue
            if held:
                m.Add(sum(held) <= sum(users))
            for u in users:
                if not held:
                    m.Add(u == 0)
                else:
                    m.AddBoolOr(held).OnlyEnforceIf(u)

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
                length = m.NewIntVar(1, axis.end + 1, f"rec_length[{v}]")
                intervals.append(m.NewOptionalIntervalVar(self.at[v], length, end + 1,
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
            if i in pinned:
                hold(size[i], axis.op(i), axis.end)
            elif i >= nf:
                hold(size[i], axis.op(i), max((axis.op(r) for r in readers[i]), default=axis.op(i)))
            else:  # the forward life every forward storage has, whatever is decided
                hold(size[i], i, max((r for r in readers[i] if r < nf), default=i))
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
        """The backward ops to cut at: all of them while the cuts stay small, else those where
        saving everything would hold the most, plus an even spread."""
        backward = list(problem.backward)
        if not window or not backward:
            return []
        per_cut = max(1, len(window))
        if per_cut * len(backward) <= MAX_CUT_TERMS:
            return backward
        k = max(1, MAX_CUT_TERMS // per_cut)
        cover = [0] * (len(problem) + 1)
        for lo, hi, c, _ in window:
            cover[lo] += c
            cover[hi + 1] -= c
        held, running = {}, 0
        for b in range(len(problem)):
            running += cover[b]
            if b >= problem.num_forward:
                held[b] = running + level_at(self.axis.op(b))
        top = sorted(backward, key=lambda b: -held[b])[: k // 2]
        spread = backward[:: max(1, len(backward) // max(1, k - len(top)))]
        return sorted(set(top) | set(spread))

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
        for ends, alive in ((self.save_end, schedule.saved), (self.rec_end, recomputed)):
            for v, end in ends.items():
                times = [self.axis.op(r) for r in self.readers[v] if r >= self.axis.nf]
                times += [at[r] for r in self.readers[v] if r in at]
                if v in at and ends is self.rec_end:
                    times.append(at[v])
                m.AddHint(end, min(max(times + [self.end_low[end.Index()]]), self.axis.end))


class _Trace(cp_model.CpSolverSolutionCallback):
    """The anytime trace: every improving schedule's cost and the bound at that moment."""

    def __init__(self, units: _Units, start: float, user):
        super().__init__()
        self.units, self.start, self.user, self.trace = units, start, user, []

    def on_solution_callback(self) -> None:
        entry = {"time": time.perf_counter() - self.start,
                 "cost": self.ObjectiveValue() * self.units.cost,
                 "bound": self.BestObjectiveBound() * self.units.cost}
        self.trace.append(entry)
        if self.user is not None:
            self.user(entry)


def _solver(options: SolverOptions, seconds: float) -> cp_model.CpSolver:
    solver = cp_model.CpSolver()
    params = solver.parameters
    params.max_time_in_seconds = max(seconds, 0.01)
    if options.workers:
        params.num_workers = options.workers
    params.random_seed = options.seed
    params.relative_gap_limit = options.relative_gap
    if options.log:
        params.log_search_progress = True
        params.log_to_stdout = False
        solver.log_callback = logger.info
    return solver


def _best_baseline(problem: Problem, budget: int, options: SolverOptions) -> Schedule | None:
    from remat.solvers import registry

    found = []
    for strategy in BASELINES:
        if strategy not in STRATEGIES:
            continue
        try:
            found.append(registry.solve(problem, budget, strategy, options))
        except BudgetError:
            continue
    return min(found, key=lambda s: (s.cost, s.peak), default=None)


def _smallest_peak(problem: Problem, units: _Units, options: SolverOptions,
                   seconds: float) -> tuple[Schedule, bool]:
    """The schedule of least simulated peak (whatever its cost), and whether that is proven."""
    model = _Model(problem, units)
    model.model.Minimize(model.peak)
    solver = _solver(options, seconds)
    status = solver.Solve(model.model)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        raise SolverError(f"optimal: no schedule fits, and the search for the smallest peak "
                          f"stopped ({solver.StatusName(status)}) within {seconds:.1f} s; "
                          "raise time_limit to learn the smallest budget that fits")
    recomputed, positions = model.decision(solver.Value)
    schedule = make_schedule(problem, recomputed, recompute_at=positions, strategy="optimal")
    return schedule, status == cp_model.OPTIMAL and units.exact_bytes


@register(Strategy.OPTIMAL)
def optimal(problem: Problem, budget: int, options: SolverOptions) -> Schedule:
    """The least-recompute-cost schedule whose simulated peak fits `budget`, least peak among
    equals; OPTIMAL when proven, else FEASIBLE with the best bound (time limit, relative gap)."""
    start = time.perf_counter()
    units = _Units.of(problem, options)
    model = _Model(problem, units)
    info = {"byte_unit": units.byte, "cost_unit": units.cost, "exact": units.exact_bytes,
            "variables": len(model.model.Proto().variables)}
    m = model.model

    def left() -> float:
        return options.time_limit - (time.perf_counter() - start)

    def fail() -> BudgetError:
        smallest, proven = _smallest_peak(problem, units, options, max(left(), 1.0))
        if smallest.peak <= budget:  # only where rounding made the model conservative
            return smallest
        words = "" if proven else " (the least found within the time limit)"
        return BudgetError(
            f"no schedule fits a budget of {budget:,} bytes: the smallest activation peak any "
            f"schedule reaches is {smallest.peak:,} bytes{words}; recomputation cannot go lower. "
            "Raise the budget or shrink what the backward must hold (smaller batch, sequence)",
            budget=budget, smallest=smallest.peak)

    # --- Stage 1: least recompute cost under the capacity (budget rounded DOWN to units).
    capacity = units.capacity(budget)
    if model.fixed_peak > capacity:
        outcome = fail()
        if isinstance(outcome, BudgetError):
            raise outcome
        return evaluate(problem, outcome, status=Status.FEASIBLE, budget=budget, bound=0.0,
                        solve_time=time.perf_counter() - start, info=info)
    m.Add(model.peak <= capacity)
    m.Minimize(model.cost)
    hint = options.hint or _best_baseline(problem, budget, options)
    if hint is not None:
        model.hint(hint)
        info["hint"] = hint.strategy
    trace = _Trace(units, start, options.on_solution)
    solver = _solver(options, left())
    status = solver.Solve(m, trace)
    if status == cp_model.INFEASIBLE:
        outcome = fail()
        if isinstance(outcome, BudgetError):
            raise outcome
        return evaluate(problem, outcome, status=Status.FEASIBLE, budget=budget, bound=0.0,
                        solve_time=time.perf_counter() - start, info=info)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        tried = f"hinted with {hint.strategy}" if hint is not None else "no baseline fits to hint"
        raise SolverError(f"optimal: no schedule within the time limit of {options.time_limit} s "
                          f"(CP-SAT {solver.StatusName(status)}; {tried}; "
                          f"{info['variables']} variables); raise time_limit or the budget")
    proven = status == cp_model.OPTIMAL
    best_cost = round(solver.ObjectiveValue())
    bound = solver.BestObjectiveBound() * units.cost
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
    return evaluate(problem, schedule, strategy=Strategy.OPTIMAL.value,
                    status=Status.OPTIMAL if proven else Status.FEASIBLE, budget=budget,
                    bound=bound, solve_time=time.perf_counter() - start,
                    info=MappingProxyType(info))
