"""The CP-SAT model with free recompute positions (`SolverOptions.free_positions`, the default).

Decisions, per candidate forward storage v (views are never candidates): `save[v]`, `rec[v]`
and, for a recomputation, `pos[v]`, the backward op it is placed before. Everything else of the
step is fixed, so the model stays O(n) in variables. Time is `units.Axis`; memory is one
cumulative constraint over optional intervals, plus redundant knapsacks at backward steps for
the LP bound.

Exactness: with tight live-range ends, the cumulative profile at every step equals `simulate`'s
live bytes. Ends are only bounded below (end >= each active reader's time); looser ends can only
overstate memory, so the least cost is exact, and the driver's second, least-peak stage makes
the ends tight where it matters (its proven peak equals simulate's, `info["model_peak"]`).
"""
from __future__ import annotations

import bisect

from ortools.sat.python import cp_model

from remat.solvers.cpsat.units import (Axis, Profile, Units, in_model_space,
                                       provide_what_is_needed)
from remat.solvers.core.deadline import Deadline, ticker
from remat.solvers.core.problem import Kind, Problem, recompute_blocker, tuple_of
from remat.solvers.core.schedule import Schedule

# Nonzeros the redundant knapsack cuts may add in all.
MAX_CUT_TERMS = 400_000


class FreeModel:
    """The CP-SAT model with free recompute positions (`SolverOptions.free_positions`), without
    capacity or objective (the stages add those)."""

    def __init__(self, problem: Problem, units: Units, deadline: Deadline | None = None):
        """OutOfTime when `deadline` passes while the model is built."""
        self.problem, self.units = problem, units
        # Its bytes are the simulator's: no rounding, and no copy it holds as a buffer that
        # a compiled step fuses into its reader (`Units.exact_bytes`).
        self.exact = units.exact_bytes
        self._tick = ticker(deadline, "building the model")
        self.axis = Axis(problem)
        self.readers = problem.storage_readers
        self.model = cp_model.CpModel()
        self._size, self._temp = units.sizes(problem)
        self._candidates = [v for v in problem.candidates if v not in problem.pinned]
        self._presolve()
        nf = problem.num_forward
        direct = {v for v in self._candidates if any(r >= nf for r in self.readers[v])}
        self._variables(direct)
        # --- What the backward needs is saved or recomputed, once; nothing else is.
        # (make_schedule derives the saved set the same way: needed minus recomputed.)
        provide_what_is_needed(self.model, problem, self._candidates, direct, self.save,
                               self.rec, self.readers)
        self._recompute_positions()
        intervals, demands = self._live_ranges()
        fixed = self._fixed_profile()
        self._cumulative(fixed, intervals, demands)
        self._knapsack_cuts(fixed.delta)
        self.cost = cp_model.LinearExpr.WeightedSum(
            list(self.rec.values()), [units.cost_of(problem.ops[v].cost) for v in self.rec])

    def _presolve(self) -> None:
        """Presolve: which candidates may be recomputed, and where at the latest.
        A zero-byte tensor is never worth recomputing: saving it holds nothing, costs nothing
        and needs none of its inputs. Tuple ops come back only with a getitem that needs them.
        latest[v]: the last backward op a recomputation of v could precede (its first direct
        backward reader, else the loosest of its recomputable readers); absent: nothing could
        need it."""
        problem, ops, readers = self.problem, self.problem.ops, self.readers
        nf = problem.num_forward
        latest: dict[int, int] = {}
        for v in reversed(self._candidates):
            if recompute_blocker(problem, v) is not None:
                continue
            if ops[v].kind is Kind.TENSOR and ops[v].size == 0:
                continue
            direct_needs = [r for r in readers[v] if r >= nf]
            through = [latest[r] for r in readers[v] if r in latest]
            if direct_needs or through:  # a recomputed reader binds only when it is recomputed
                latest[v] = min(direct_needs) if direct_needs else max(through)
        self.latest = latest

    def _variables(self, direct: set[int]) -> None:
        """The decisions: rec, pos and save; `at[v]`, the time a recomputation of v runs."""
        m, ops, latest, axis = self.model, self.problem.ops, self.latest, self.axis
        nf = self.problem.num_forward
        self.rec = {v: m.NewBoolVar(f"rec[{v}]") for v in latest}
        self.pos = {v: m.NewIntVar(nf, latest[v], f"pos[{v}]") for v in latest}
        self.save: dict[int, cp_model.IntVar] = {}
        for v in self._candidates:
            could_need = v in direct or any(r in self.rec for r in self.readers[v])
            if could_need and ops[v].kind is not Kind.TUPLE:  # a tuple cannot be saved
                self.save[v] = m.NewBoolVar(f"save[{v}]")
        # When recomputed before b, v runs at base(b) + v.
        self.at = {v: axis.width * self.pos[v] + (nf - nf * axis.width + v) for v in latest}

    def _recompute_positions(self) -> None:
        """Recompute positions: before every recomputed reader (before every backward reader
        is the domain), and a getitem where its tuple op is (recomputing the tuple makes it)."""
        m = self.model
        for v in self.latest:
            self._tick()
            m.Add(self.pos[v] == self.latest[v]).OnlyEnforceIf(self.rec[v].Not())  # no symmetry
            for r in self.readers[v]:
                if r in self.rec:
                    m.Add(self.pos[v] <= self.pos[r]).OnlyEnforceIf([self.rec[v], self.rec[r]])
            t = tuple_of(self.problem, v)
            if t is not None:
                m.Add(self.pos[v] == self.pos[t]).OnlyEnforceIf(self.rec[v])

    # --- Memory.

    def _live_ranges(self) -> tuple[list, list[int]]:
        """Live ranges of the decided storages (optional intervals), memory per unit: the
        cumulative's intervals and demands so far."""
        readers, axis, size, temp = self.readers, self.axis, self._size, self._temp
        nf = self.problem.num_forward
        intervals, demands = [], []
        self.save_end: dict[int, cp_model.IntVar] = {}
        self.rec_end: dict[int, cp_model.IntVar] = {}
        self.rec_length: dict[int, cp_model.IntVar] = {}
        self.end_low: dict[int, int] = {}
        for v in self._candidates:
            self._tick()
            last_fwd = max((r for r in readers[v] if r < nf), default=v)
            last_bwd = max((axis.op(r) for r in readers[v] if r >= nf), default=None)
            later = [r for r in readers[v] if r in self.rec]
            if v in self.save and size[v]:
                intervals.append(self._saved_copy(v, last_fwd, last_bwd, later))
                demands.append(size[v])
            if v in self.rec and size[v]:
                intervals.append(self._recomputed_copy(v, last_bwd, later))
                demands.append(size[v])
            if v in self.rec and temp[v]:
                intervals.append(self.model.NewOptionalFixedSizeIntervalVar(
                    self.at[v], 1, self.rec[v], f"temp[{v}]"))
                demands.append(temp[v])
        return intervals, demands

    def _saved_copy(self, v: int, last_fwd: int, last_bwd: int | None, later: list[int]):
        """The saved copy: beyond its last forward reader, to its last backward reader (and to
        every recomputed reader)."""
        m, axis = self.model, self.axis
        start = last_fwd + 1
        low = max(start, last_bwd if last_bwd is not None else axis.nf)
        end = self.save_end[v] = m.NewIntVar(low, axis.end, f"save_end[{v}]")
        self.end_low[end.Index()] = low
        for r in later:
            m.Add(end >= self.at[r]).OnlyEnforceIf(self.rec[r])
        return m.NewOptionalIntervalVar(start, end + 1 - start, end + 1, self.save[v],
                                        f"saved[{v}]")

    def _recomputed_copy(self, v: int, last_bwd: int | None, later: list[int]):
        """The recomputed copy: from its recomputation to its last backward reader (and to
        every recomputed reader)."""
        m, axis = self.model, self.axis
        low = last_bwd if last_bwd is not None else axis.nf
        end = self.rec_end[v] = m.NewIntVar(low, axis.end, f"rec_end[{v}]")
        self.end_low[end.Index()] = low
        m.Add(end >= self.at[v])
        for r in later:
            m.Add(end >= self.at[r]).OnlyEnforceIf(self.rec[r])
        # A getitem's copy exists from the step after its tuple op's recomputation
        # (simulate's rule): pos[v] == pos[t] makes that at[v] - (v - t) + 1.
        t = tuple_of(self.problem, v)
        start = self.at[v] if t is None else self.at[v] + (t + 1 - v)
        length = self.rec_length[v] = m.NewIntVar(1, axis.end + 1, f"rec_length[{v}]")
        return m.NewOptionalIntervalVar(start, length, end + 1, self.rec[v], f"again[{v}]")

    def _fixed_profile(self) -> Profile:
        """Everything else is fixed: one profile (temps, pinned values, the backward's own
        values, every forward value's forward life)."""
        problem, axis, readers = self.problem, self.axis, self.readers
        nf, size, temp = problem.num_forward, self._size, self._temp
        fixed = Profile()
        hold = fixed.hold
        for i, op in enumerate(problem.ops):
            hold(temp[i], axis.op(i), axis.op(i))
            if problem.root[i] != i:
                continue
            t = tuple_of(problem, i)
            made = axis.op(i) if t is None else axis.op(t) + 1  # simulate's rule for getitems
            if i in problem.pinned:
                hold(size[i], made, axis.end)
            elif i >= nf:
                hold(size[i], made, max((axis.op(r) for r in readers[i]), default=axis.op(i)))
            else:  # the forward life every forward storage has, whatever is decided
                hold(size[i], made, max((r for r in readers[i] if r < nf), default=i))
        return fixed

    def _cumulative(self, fixed: Profile, intervals: list, demands: list[int]) -> None:
        """The fixed profile added as constant segments, then one cumulative constraint: the
        memory of every step is at most the peak."""
        m = self.model
        self.fixed_peak = fixed.add_to(m, intervals, demands)
        self.peak = m.NewIntVar(self.fixed_peak, max(sum(demands), self.fixed_peak), "peak")
        m.AddCumulative(intervals, demands, self.peak)

    def _knapsack_cuts(self, delta: dict[int, int]) -> None:
        """Redundant knapsacks at backward steps, for the LP bound: the cumulative alone
        relaxes poorly with optional intervals of variable start. At backward op b, a saved
        copy is live if b comes before its last backward reader; a recomputed one too if
        its latest position is already behind. Both are lower bounds of the exact profile."""
        m, readers, size, latest = self.model, self.readers, self._size, self.latest
        nf = self.problem.num_forward
        level_at = self._levels(delta)
        window = []
        for v in self._candidates:
            last = max((r for r in readers[v] if r >= nf), default=None)
            if last is None or not size[v]:
                continue
            if v in self.save:
                window.append((nf, last, size[v], self.save[v]))
            if v in self.rec and latest[v] <= last:
                window.append((latest[v], last, size[v], self.rec[v]))
        for b in self._cut_points(self.problem, window, level_at):
            self._tick()
            terms = [(c, x) for lo, hi, c, x in window if lo <= b <= hi]
            if terms:
                m.Add(sum(c * x for c, x in terms) + level_at(self.axis.op(b)) <= self.peak)
        # The last forward step: every saved storage past its last forward reader is live.
        boundary = [(size[v], self.save[v]) for v in self._candidates if v in self.save
                    and size[v] and max((r for r in readers[v] if r < nf), default=v) < nf - 1]
        if boundary and nf:
            m.Add(sum(c * x for c, x in boundary) + level_at(nf - 1) <= self.peak)

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
        schedule = in_model_space(self.problem, schedule, self.rec)
        if schedule is None:
            return  # not a schedule of this model's space
        recomputed = schedule.recomputed
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

