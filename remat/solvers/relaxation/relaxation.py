"""The relaxation behind `remat.solvers.relaxation.bound`: the joint model over backward steps (see
that module's docstring for why it bounds every schedule), built and solved under the call's
`Deadline`. `remat.solvers.relaxation.relaxed` reads plans off it.
"""
from __future__ import annotations

import math
from typing import Callable, Sequence

from ortools.sat.python import cp_model

from remat.solvers.core.deadline import DTIME_WEIGHT, Deadline, modelled, ticker
from remat.solvers.core.problem import Kind, Problem, recompute_blocker

__all__ = ["COST_RESOLUTION", "Relaxation", "WORKERS"]

# CP-SAT workers for the relaxations when the caller names none: one, with the full linear
# relaxation (`_solve`). With the default search, 1 to 4 workers did not prove a Llama stack's
# step in 20 s, and the 8-worker portfolio proved it through its max_lp subsolver alone.
WORKERS = 1
# Costs become integers in this fraction of their total, rounded down, so that the integer
# bound stays a bound of the real costs (the rounding loses at most ops x this share).
COST_RESOLUTION = 1e-9


class Relaxation:
    """The joint model over backward ops `steps`: per forward storage that the backward may
    need, save[v] or recompute[v] once; per step b, keep[b, v] (v live at b's step) and
    after[b, v] (v recomputed after it). `rich`: valid over the richer execution model too
    (recomputing twice, within the forward, offloading where the problem has a host link)."""

    def __init__(self, problem: Problem, steps: Sequence[int], rich: bool = False,
                 deadline: Deadline | None = None, in_order: bool = False):
        """OutOfTime when `deadline` passes while it is built; in deterministic mode the
        build is charged to it (`modelled`). `in_order`: joint steps keep the order of
        recomputations (`_in_order`) and, over the rich space, count each value's runs
        (`_count_runs`), for the bounds proven alone (`recompute_bound`, `joint_bound`,
        `loaded_bound`: mamba at 60 %); the plan-reading turns, which must end within their
        share of the limit, leave those rows out (they gained nothing there in the runs
        measured)."""
        self.deadline = deadline or Deadline(math.inf)
        self.deadline.charge(modelled("relaxation step", len(problem)) * len(steps))
        self._tick = ticker(deadline, "building a relaxation")
        self.model, self.problem = cp_model.CpModel(), problem
        self._inputs, self._rich = problem.storage_inputs, rich
        self._nf, self._pinned = problem.num_forward, problem.pinned
        self._bandwidth = problem.host_bandwidth if rich else None
        # One step alone needs no whole-step decision: what it recomputes after it is its cost.
        # (Solved without that layer, real graphs' single steps prove in a second, not 20.)
        self._joint = len(steps) > 1
        self.redo: dict[int, cp_model.IntVar] = {}
        self._save: dict[int, cp_model.IntVar] = {}
        self._richer_space(steps, in_order)
        if self._joint:
            self._whole_step_decision(len(steps))
        self.keep: dict[int, dict[int, cp_model.IntVar]] = {}
        self._fused: dict[int, dict[int, cp_model.IntVar]] = {}  # `_fused_at`
        self._order: list[dict] = []  # the joint steps' `after`, for `_in_order`
        earlier: dict[int, cp_model.IntVar] | None = None
        for b in sorted(steps):
            after = self._step(b, earlier)
            if self._joint and in_order:
                self._order.append(after)
            earlier = after
        if not self._joint:  # the step's own recomputations after it are all there is to pay
            self.redo = earlier or {}

    def _forward(self, storages) -> list[int]:
        """The forward storages among `storages` that the model decides: outputs are always
        held (fixed bytes, never decided)."""
        return [s for s in storages if s < self._nf and s not in self._pinned]

    def _closure(self, start) -> list[int]:
        """`start` and the decided forward storages they read, transitively, sorted."""
        reach, frontier = set(), list(start)
        while frontier:
            v = frontier.pop()
            if v not in reach:
                reach.add(v)
                frontier.extend(self._forward(self._inputs[v]))
        return sorted(reach)

    def _offloadable(self, v: int) -> bool:
        op = self.problem.ops[v]
        return bool(self._bandwidth) and op.kind is Kind.TENSOR and op.size > 0

    def _richer_space(self, steps: Sequence[int], in_order: bool) -> None:
        """The richer model (`rich`): save[v] means no backward recomputation and no load; a
        value loaded from host (off[v]) is not held between its last forward reader and its
        load, at no cost (its transfers may be hidden); one recomputed in the backward may be
        recomputed again, so at a step it may be both held and recomputed after it, for a
        second run's cost (twice[v]).

        Over the rich space, only a value that a step reads itself needs to be both held at a
        step and recomputed after it: any other value held there and recomputed after it may
        as well not be held (nothing at the step reads it, and what it feeds after the step
        is fed by its recomputation), for less room and one run less. So the single model's
        rule holds for the others, and the bound stays a bound of the rich space; the model
        is the single one's but for those few values (the 70B's two steps: 5 CPU seconds,
        7 with the rule relaxed for every value)."""
        self._offloaded: dict[int, cp_model.IntVar] = {}
        self.off: dict[int, tuple[cp_model.IntVar, float]] = {}
        self.twice: dict[int, cp_model.IntVar] = {}
        self._read_by_steps = {s for b in steps for s in self._forward(self._inputs[b])}
        # Proven alone over the rich space (`in_order`), every value is held exactly as the
        # plan holds it, so that `_in_order` can count its runs from the steps that hold it.
        self._counted = self._rich and self._joint and in_order

    def _whole_step_decision(self, count: int) -> None:
        """Per forward storage that the backward may need, save[v], recompute[v] (`redo`) or,
        over the rich space, offload[v], once for all `count` joint steps; every value the
        backward reads is one of them, and a recomputed value's inputs are available to it."""
        m, problem, off = self.model, self.problem, self._offloaded
        read_by_backward = {s for r in problem.backward for s in self._forward(self._inputs[r])}
        values = self._closure(read_by_backward)
        self._last_read = {v: max((r for r in problem.storage_readers[v] if r >= self._nf),
                                  default=-1) for v in values}
        for v in values:
            self._decide_value(v, count)
        for v in read_by_backward:
            m.AddBoolOr([self._save[v], self.redo[v], *([off[v]] if v in off else [])])
        for u in values:
            for s in self._forward(self._inputs[u]):
                m.Add(self._save[s] + self.redo[s] + off.get(s, 0) >= self.redo[u])

    def _decide_value(self, v: int, count: int) -> None:
        """`v`'s whole-step variables (save, redo, off, twice), at most one of the first three."""
        m, problem, off = self.model, self.problem, self._offloaded
        # A tuple op holds no storage of its own: what is live of it are its getitems.
        tuple_op = problem.ops[v].kind is Kind.TUPLE
        self._save[v] = m.NewConstant(0) if tuple_op else m.NewBoolVar(f"s{v}")
        self.redo[v] = (m.NewBoolVar(f"r{v}") if recompute_blocker(problem, v) is None
                        else m.NewConstant(0))
        if self._offloadable(v):
            off[v] = m.NewBoolVar(f"o{v}")
            # Its transfers may run wholly under compute (remat.solvers.timeline.overlap):
            # what the step waits for them is bounded by nothing above 0.
            self.off[v] = (off[v], 0.0)
        if recompute_blocker(problem, v) is not None:
            pass
        elif self._counted:  # its further runs, counted in `_in_order`
            self.twice[v] = m.NewIntVar(0, count + 1, f"t{v}")
        elif self._rich and v in self._read_by_steps:
            self.twice[v] = m.NewBoolVar(f"t{v}")
        m.Add(self._save[v] + self.redo[v] + off.get(v, 0) <= 1)

    def _step(self, b: int, earlier: dict[int, cp_model.IntVar] | None
              ) -> dict[int, cp_model.IntVar]:
        """Step `b`'s keep[v] and after[v] for every value it or a later step may need, and
        their rules; returns `after` (`earlier`: the previous joint step's)."""
        m, problem = self.model, self.problem
        ahead = {s for r in range(b, len(problem.ops)) for s in self._forward(self._inputs[r])}
        keep, after = {}, {}
        for v in self._closure(ahead):
            self._tick()
            tuple_op = problem.ops[v].kind is Kind.TUPLE
            keep[v] = m.NewConstant(0) if tuple_op else m.NewBoolVar(f"k{b}_{v}")
            after[v] = (m.NewBoolVar(f"a{b}_{v}") if recompute_blocker(problem, v) is None
                        else m.NewConstant(0))
            if self._joint:
                self._as_decided(b, v, keep[v], after[v], earlier)
        if not self._joint:
            self._offload_after(b, keep, after)
        self._step_needs(b, ahead, keep, after)
        self.keep[b] = keep
        self._fused_at(b, keep)
        return after

    def _fused_at(self, b: int, keep: dict) -> None:
        """`fused[b][v]`: a value of `Problem.fused_recomputations` that b reads is held at
        no bytes, as the simulator holds a recomputed copy of one that serves one op, and its
        inputs are held instead (those that are such values themselves may be fused with it,
        and are left free). Without it the bounds were above what plans reach: a Qwen2's
        compiled problem "needed" 3.22e9 recompute FLOPs at a budget a plan of 3.09e9 fits.
        A saved value is a buffer (in the joint model, only a recomputed one is fused); where
        the copy serves more ops the simulator counts it, and the bound is only lower."""
        problem, free, m = self.problem, self.problem.fused_recomputations, self.model
        fused = {}
        for v in self._forward(self._inputs[b]):
            if v not in free or not problem.ops[v].size or recompute_blocker(problem, v):
                continue
            fused[v] = m.NewBoolVar(f"f{b}_{v}")
            for u in self._forward(self._inputs[v]):
                if u not in free and problem.ops[u].kind is not Kind.TUPLE:  # no storage
                    m.AddImplication(fused[v], keep[u])
            if self._joint:
                m.AddImplication(fused[v], self.redo[v])
        self._fused[b] = fused

    def _as_decided(self, b: int, v: int, keep, after, earlier) -> None:
        """Step `b`'s holds and recomputations of `v` as the whole-step decision has them."""
        m, off, save, redo = self.model, self._offloaded, self._save[v], self.redo[v]
        if self._rich and (v in self._read_by_steps or self._counted):
            m.Add(keep <= save + redo + off.get(v, 0))
            if v in self.twice:  # held from one backward run, recomputed after: two runs
                m.Add(self.twice[v] >= keep + after - 1)
        else:
            m.Add(keep + after <= save + redo + off.get(v, 0))
        m.AddImplication(after, redo)
        if self._last_read[v] >= b:  # a saved value lives to its last reader
            m.AddImplication(save, keep)
        if earlier is not None:  # recomputed after b: after every earlier step too
            m.AddImplication(after, earlier[v])

    def _offload_after(self, b: int, keep: dict, after: dict) -> None:
        """One step alone: a saved tensor loaded back from host after b is not held at b."""
        off = {v: self.model.NewBoolVar(f"o{b}_{v}") for v in keep if self._offloadable(v)}
        self._offloaded = off
        self.off = {v: (x, 0.0) for v, x in off.items()}  # free, at the least
        for v, x in off.items():
            self.model.Add(x + after[v] <= 1)  # an offloaded value is saved, never recomputed

    def _step_needs(self, b: int, ahead: set[int], keep: dict, after: dict) -> None:
        """What step `b` and those after it read is held at b, recomputed or loaded after it;
        what b reads is held; a value recomputed after b has its inputs then."""
        m, off = self.model, self._offloaded
        for v in ahead:
            m.AddBoolOr([keep[v], after[v], *([off[v]] if v in off else [])])
        for s in self._forward(self._inputs[b]):
            m.Add(keep[s] == 1)
        for u in after:
            for s in self._forward(self._inputs[u]):
                m.Add(keep[s] + after[s] + (off[s] if s in off else 0) >= after[u])

    def _in_order(self, cost: Callable) -> None:
        """The order at each joint step, for the least cost. A value recomputed in the
        backward serves every backward read from a backward run (make_schedule's rules), so one
        recomputed after the step whose recomputed reader runs only before it ran before the
        step too. In the single space, where a value runs once, that cannot be: it feeds only
        readers recomputed after the step too. (Without the rule the joint model let a value
        feed a reader recomputed before the step and still be recomputed after it, for one run
        and no room held: mamba at 60 %, every backward step joined, 5.42e-05 against the
        6.22e-05 the order proves.) Over the rich space it can be, for a second run, which the
        rule charges (`twice`), and the runs the holds imply are counted (`_count_runs`):
        mamba at 60 %, its rich plan's 20 most loaded steps joined, 5.40e-05 with the charge
        alone, 5.827e-05 with the count, against the plan's 5.831e-05. Not for the least peak:
        `peak_bound`'s floor is quoted under "auto" too, and on `unet()` the rich space fits
        below the single space's floor with the order (43.6 MB; one step: 35.2)."""
        m, ops = self.model, self.problem.ops
        # A run that costs nothing needs no counting (views' bases, transposes: half of
        # mamba's values).
        charged = {s for s in self.twice if cost(ops[s]) > 0}
        for after in self._order:
            for u, redo_u in self.redo.items():
                for s in self._forward(self._inputs[u]):
                    if s not in after or (self._rich and s not in charged):
                        continue
                    if not self._rich:
                        m.Add(after[s] <= after.get(u, 0) + 1 - redo_u)
                        continue
                    # Two runs of s: one before u's last (before the step), one after it.
                    m.Add(self.twice[s] >= after[s] - after.get(u, 0) + redo_u - 1)
        if self._rich and self._order:  # proven alone: the holds are exact (`counted`)
            self._count_runs(charged)
        self._order = []

    def _count_runs(self, charged: set[int]) -> None:
        """Over the rich space, a value recomputed in the backward is held at a step only as a
        copy of a backward run before it (make_schedule's rules; its forward copy serves no
        backward read), so each stretch of joined steps that hold it, after a step that does
        not, starts with a run of its own, and a run after the last step that holds it is one
        more: its further runs are at least those, less one. (Mamba at 60 %: the relaxation
        held `exp_3` at joined steps 319, 334, 336 and 350 and at none between, four runs, for
        the one further run that `twice` charged before.) Holds are exact in these models
        (`counted`); values whose runs cost nothing are left out."""
        m = self.model
        steps = list(self.keep)
        for s in charged:
            further, redo = self.twice[s], self.redo[s]
            held = [self.keep[b].get(s) for b in steps]
            starts, before = [], 0
            for h in held:
                if h is None:  # not needed at this step nor after it
                    break
                start = m.NewBoolVar("")
                m.Add(start >= h - before + redo - 1)
                starts.append(start)
                before = h
            # A run after step i held at no later step: not the run of any of those holds.
            late = m.NewBoolVar("")
            for i, after in enumerate(self._order):
                if s in after:
                    later = [h for h in held[i + 1:] if h is not None]
                    m.Add(late >= after[s] - sum(later))
            m.Add(further >= sum(starts) + late - 1)

    def _bytes(self, b: int):
        ops = self.problem.ops
        return (sum(ops[v].size * k for v, k in self.keep[b].items() if ops[v].size)
                - sum(ops[v].size * f for v, f in self._fused[b].items()))

    def least_cost(self, rooms: dict[int, int], cost: Callable, seconds: float,
                   workers: int, gap: float = 0.0) -> tuple[float, bool]:
        """The least cost (a bound: CP-SAT's best bound of it), and whether it is proven; the
        search may stop once its solution is within `gap` (relative) of that bound."""
        ops = self.problem.ops
        self._in_order(cost)
        for b, room in rooms.items():
            if self.keep[b]:
                self.model.Add(self._bytes(b) <= room)
        terms = [(self.redo[v], cost(ops[v])) for v in self.redo]
        terms += [(x, cost(ops[v])) for v, x in self.twice.items()]
        terms += list(self.off.values())
        total = sum(w for _, w in terms)
        if total <= 0:
            return self._solve(1.0, seconds, workers, costless=True)
        unit = total * COST_RESOLUTION
        self.model.Minimize(sum(math.floor(w / unit) * x for x, w in terms if w >= unit))
        return self._solve(unit, seconds, workers, gap=gap)

    def least_peak(self, fixed: dict[int, int], seconds: float,
                   workers: int) -> tuple[float, bool]:
        """The least, over the model's choices, of the most that any of the steps holds."""
        top = sum(op.size for op in self.problem.ops) + max(fixed.values())
        peak = self.model.NewIntVar(0, top, "peak")
        for b, held in fixed.items():
            self.model.Add(held + self._bytes(b) <= peak)
        self.model.Minimize(peak)
        return self._solve(1, seconds, workers)

    def recomputed(self) -> set[int] | None:
        """What the last solve's solution recomputes (None: it found no solution)."""
        if self._status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            return None
        return {v for v, x in self.redo.items()
                if not isinstance(x, int) and self._solver.Value(x)}

    def single(self) -> bool:
        """Whether the last solve's solution lies in the single space too: nothing recomputed
        twice, nothing offloaded (False where it found no solution)."""
        if self._status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            return False
        chosen = [*self.twice.values(), *(x for x, _ in self.off.values())]
        return not any(self._solver.Value(x) for x in chosen if not isinstance(x, int))

    def _solve(self, unit: float, seconds: float, workers: int,
               costless: bool = False, gap: float = 0.0) -> tuple[float, bool]:
        solver = self._solver = cp_model.CpSolver()
        self.deadline.limit_solver(solver.parameters, max(seconds, 0.05),
                                   DTIME_WEIGHT["relaxation"])
        solver.parameters.num_workers = workers or WORKERS
        # One worker with the full linear relaxation (the portfolio's max_lp, which proves
        # these knapsacks): as fast as the 8-worker portfolio or faster on a shared 2-core
        # machine (7B step: 0.9 s against 1.8 s; 10,000 ops: 7 s against 16 s), and
        # deterministic, as `Deadline`'s deterministic mode needs.
        solver.parameters.linearization_level = 2
        # One presolve pass: its later passes expand the keep/after implications into clauses
        # (a 20,000-op stack's step: 330,000) and took most of the time for no stronger bound
        # (that step: 8.3 s against 2.9 s, the same bound; 5,000 ops 6.3 against 0.6 s, the
        # 70B's two steps 6.5 against 5.8 s; without presolve the 70B's did not end in 30 s).
        solver.parameters.max_presolve_iterations = 1
        solver.parameters.relative_gap_limit = gap
        with self.deadline.guard(solver, "solving a relaxation", DTIME_WEIGHT["relaxation"]):
            status = self._status = solver.Solve(self.model)
        if status == cp_model.INFEASIBLE:
            return math.inf, True
        if costless:
            return 0.0, status in (cp_model.OPTIMAL, cp_model.FEASIBLE)
        if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            # No solution in the time given, but what the search proved still bounds it
            # (a minimization's best bound; -inf or nan when it proved nothing).
            proved = solver.BestObjectiveBound()
            if not math.isfinite(proved) or proved <= 0:
                return 0.0, False
            return math.ceil(proved - 1e-6) * (1 if unit == 1 else unit * (1 - 1e-12)), False
        # The objective is an integer: its bound rounds up, less float noise (448.00000000000006);
        # back in seconds, the product rounds down by more than a float's error, so that it
        # stays at most the true least cost (each weight was rounded down already).
        units = math.ceil(solver.BestObjectiveBound() - 1e-6)
        value = units if unit == 1 else units * unit * (1 - 1e-12)  # bytes: exact integers
        return value, status == cp_model.OPTIMAL and not gap
