"""The CP-SAT model with just-in-time recompute positions (`free_positions=False`; the
execution model's rule, docs/execution-model.md, and make_schedule's default: each value
recomputed just before the first backward op that needs it): the decisions are the booleans
alone. See `JitModel`.
"""
from __future__ import annotations

from bisect import bisect_right

from ortools.sat.python import cp_model

from remat.solvers.core.deadline import Deadline, ticker
from remat.solvers.core.problem import Kind, Problem, recompute_blocker, tuple_of
from remat.solvers.core.schedule import Schedule
from remat.solvers.cpsat.jit_fused import fusion_of
from remat.solvers.cpsat.jit_hint import hint
from remat.solvers.cpsat.units import Units, memory_chain, provide_what_is_needed


class JitModel:
    """The CP-SAT model with just-in-time positions (make_schedule's default).

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
    makes them tight where the peak is (info["model_peak"] equals simulate's peak). Values a
    compiled step fuses into their readers are counted as the simulator counts them
    (`jit_fused`); `exact` says whether the model's bytes are the simulator's for every
    decision (the units round none, and every such value is encoded), so that what CP-SAT
    proves on it holds."""

    def __init__(self, problem: Problem, units: Units, deadline: Deadline | None = None):
        """OutOfTime when `deadline` passes while the model is built."""
        self.problem, self.units = problem, units
        self._tick = ticker(deadline, "building the model")
        self.readers = problem.storage_readers
        self.model = cp_model.CpModel()
        self._size, self._temp = units.sizes(problem)
        self._candidates = [v for v in problem.candidates if v not in problem.pinned]
        self._may_be_recomputed()
        jit_positions = self._positions()
        direct = {v for v in self._candidates if self.first_direct[v] is not None}
        self._decision_variables(direct, jit_positions)
        # --- Step 3, what the backward needs is saved or recomputed, once; nothing else is.
        provide_what_is_needed(self.model, problem, self._candidates, direct, self.save,
                               self.rec, self.readers)
        self._just_in_time()
        self._slots()
        self._fixed_profile()
        self.events: dict[int, list[tuple[int, object]]] = {}
        # Copies fused into the one step they serve: no bytes, their inputs read there.
        self.fusion = fusion_of(self)
        self.exact = units.exact_rounding and self.fusion.exact
        self._decided_events()
        self._memory_chain()
        self.cost = cp_model.LinearExpr.WeightedSum(
            list(self.rec.values()), [units.cost_of(problem.ops[v].cost) for v in self.rec])

    # --- Step 1, presolve.

    def _may_be_recomputed(self) -> None:
        """Which candidates may be recomputed (as in FreeModel): `may`, found in a reverse
        sweep, since a value is worth recomputing only for a direct backward reader or a reader
        that may itself be recomputed. `first_direct[v]`: v's first direct backward reader."""
        problem, ops, readers = self.problem, self.problem.ops, self.readers
        nf = problem.num_forward
        first_direct = {v: min((r for r in readers[v] if r >= nf), default=None)
                        for v in self._candidates}
        self.first_direct = first_direct
        may: set[int] = set()
        for v in reversed(self._candidates):
            if recompute_blocker(problem, v) is not None:
                continue
            if ops[v].kind is Kind.TENSOR and ops[v].size == 0:
                continue
            if first_direct[v] is not None or any(r in may for r in readers[v]):
                may.add(v)
        self.may = may

    def _positions(self) -> dict[int, list[int]]:
        """The positions P(v) the just-in-time rule can give each value of `may`: its first
        direct reader, or a position of a recomputed reader before that. A tuple op goes where
        its first recomputed getitem would; its getitems go with it. Returns each getitem's own
        positions (the rule before its tuple's), which `jit_le` encodes."""
        problem, ops, readers, may = self.problem, self.problem.ops, self.readers, self.may
        jit_positions: dict[int, list[int]] = {}
        positions: dict[int, list[int]] = {}
        for v in sorted(may, reverse=True):
            if ops[v].kind is Kind.TUPLE:
                getitems = [g for g in problem.users[v] if g in may]
                positions[v] = sorted(set().union(*(jit_positions[g] for g in getitems)))
                for g in getitems:
                    positions[g] = [p for p in positions[v] if p <= jit_positions[g][-1]]
                continue
            d = self.first_direct[v]
            found = {d} if d is not None else set()
            for w in readers[v]:
                if w in may:
                    found.update(p for p in positions[w] if d is None or p <= d)
            own = sorted(found)
            if tuple_of(problem, v) is not None:
                jit_positions[v] = own
            positions[v] = own
        self.positions = positions
        return jit_positions

    # --- Step 2, decision variables.

    def _decision_variables(self, direct: set[int], jit_positions: dict[int, list[int]]) -> None:
        """rec, save, and the position order literals (`le`, and a getitem's own `jit_le`)."""
        m, ops, readers = self.model, self.problem.ops, self.readers
        self.rec = {v: m.NewBoolVar(f"rec[{v}]") for v in sorted(self.may)}
        self.save: dict[int, cp_model.IntVar] = {}
        for v in self._candidates:
            could_need = v in direct or any(r in self.rec for r in readers[v])
            if could_need and ops[v].kind is not Kind.TUPLE:  # a tuple cannot be saved
                self.save[v] = m.NewBoolVar(f"save[{v}]")
        self.le = {v: self._order_literals(v, self.positions[v], "le") for v in self.rec}
        self.jit_le = {g: self._order_literals(g, jit_positions[g], "jit_le")
                       for g in self.rec if g in jit_positions}

    def _order_literals(self, v: int, allowed: list[int], name: str) -> dict[int, object]:
        """literals[p] = "v is recomputed at or before p", over the `allowed` positions: each
        implies the next, and the last is rec[v] itself."""
        m = self.model
        literals = {p: m.NewBoolVar(f"{name}[{v},{p}]") for p in allowed[:-1]}
        literals[allowed[-1]] = self.rec[v]
        for p, q in zip(allowed, allowed[1:]):
            m.AddImplication(literals[p], literals[q])
        return literals

    @staticmethod
    def _le_at(literals: dict, p: int, positions: list[int] | None = None):
        """The literal "at or before p", from the largest allowed position <= p (the
        positions are the dict's keys, in increasing order; `positions` lists them)."""
        positions = list(literals) if positions is None else positions
        at = bisect_right(positions, p)
        return literals[positions[at - 1]] if at else None

    # --- Step 4, the just-in-time rule on the order literals.

    def _just_in_time(self) -> None:
        """The rule for every recomputable value: a tuple op where its getitems are, a getitem
        by its own rule and with its tuple, any other value by its own rule."""
        for v in self.rec:
            self._tick()
            if self.problem.ops[v].kind is Kind.TUPLE:
                self._tuple_at_its_getitems(v)
            elif v in self.jit_le:
                self._jit(v, self.jit_le[v])
                self._getitem_with_its_tuple(v)
            else:
                self._jit(v, self.le[v])

    def _jit(self, v: int, literals: dict) -> None:
        """v is recomputed at or before p iff it is recomputed and (its first direct reader is
        at or before p, or a recomputed reader is). A recomputed reader forces v held, so "v not
        saved" means "v recomputed": le[v,p] + save[v] >= le[w,p], which is tighter in the LP
        than the conjunction."""
        m = self.model
        d = self.first_direct[v]
        keep = self.save.get(v)
        recomputed_readers = [(self.le[w], list(self.le[w])) for w in self.readers[v]
                              if w in self.rec]
        for p, lit in literals.items():
            if d is not None and p >= d:
                continue  # the direct reader binds: lit is rec[v] (the last position)
            if lit is self.rec[v] and d is None:
                continue  # "recomputed at all" is step 3's business
            ups = []
            for le_w, positions_w in recomputed_readers:
                wl = self._le_at(le_w, p, positions_w)
                if wl is not None:
                    ups.append(wl)
                    m.Add(lit + (keep if keep is not None else 0) >= wl)
            m.Add(lit <= sum(ups)) if ups else m.Add(lit == 0)

    def _tuple_at_its_getitems(self, v: int) -> None:
        """A tuple op is recomputed at or before p iff one of its recomputed getitems is, by
        the getitem's own rule."""
        m = self.model
        getitems = [g for g in self.problem.users[v] if g in self.rec]
        for p, lit in self.le[v].items():
            ups = [x for x in (self._le_at(self.jit_le[g], p) for g in getitems) if x is not None]
            for x in ups:
                m.AddImplication(x, lit)
            m.Add(lit <= sum(ups)) if ups else m.Add(lit == 0)

    def _getitem_with_its_tuple(self, g: int) -> None:
        """A recomputed getitem comes with its tuple op: le[g,p] = rec[g] and le[t,p]."""
        m = self.model
        t = tuple_of(self.problem, g)
        for p, lit in self.le[g].items():
            if lit is self.rec[g]:
                continue
            tl = self._le_at(self.le[t], p)
            if tl is None:
                m.Add(lit == 0)
                continue
            m.AddImplication(lit, tl)
            m.AddBoolOr([lit, self.rec[g].Not(), tl.Not()])

    # --- Step 5, the slots.

    def _slots(self) -> None:
        """`op_slot` of every op, and `slot_of[(b, v)]`: the sub-slot of a recomputation of v
        placed before backward op b, in forward order before b's own slot (as `simulate` runs
        them); `slots` in all."""
        nf = self.problem.num_forward
        before: dict[int, list[int]] = {}
        for v, allowed in self.positions.items():
            for p in allowed:
                before.setdefault(p, []).append(v)
        slot_of: dict[tuple[int, int], int] = {}
        self.op_slot = list(range(nf))
        slots = nf
        for b in self.problem.backward:
            for v in sorted(before.get(b, ())):
                slot_of[(b, v)] = slots
                slots += 1
            self.op_slot.append(slots)
            slots += 1
        self.slots = slots
        self.slot_of = slot_of

    # --- Step 6, the fixed profile.

    def _fixed_profile(self) -> None:
        """`fixed`: the bytes at each slot that no decision moves (temps, pinned values, the
        backward's own values, every forward value's forward life); `fixed_peak` its most."""
        problem, readers, op_slot, slots = self.problem, self.readers, self.op_slot, self.slots
        nf, size, temp = problem.num_forward, self._size, self._temp
        fixed = [0] * (slots + 1)

        def hold(amount: int, first: int, last: int) -> None:
            if amount:
                fixed[first] += amount
                fixed[last + 1] -= amount

        for i, op in enumerate(problem.ops):
            hold(temp[i], op_slot[i], op_slot[i])
            if problem.root[i] != i:
                continue
            t = tuple_of(problem, i)
            made = op_slot[i] if t is None else op_slot[t] + 1  # simulate's rule for getitems
            if i in problem.pinned:
                hold(size[i], made, slots - 1)
            elif i >= nf:
                hold(size[i], made, max((op_slot[r] for r in readers[i]), default=op_slot[i]))
            else:
                hold(size[i], made, max((r for r in readers[i] if r < nf), default=i))
        for t in range(1, slots + 1):
            fixed[t] += fixed[t - 1]
        self.fixed = fixed[:slots]
        self.fixed_peak = max(self.fixed, default=0)

    # --- Step 7, the decided bytes as events on the slots.

    def _decided_events(self) -> None:
        """`events[t]`: the (coefficient, literal) terms by which the decided bytes change at
        slot t. A candidate v of s units contributes, at a forward slot past its last forward
        reader, s * save[v]; at a backward slot t, s * (H(t) - rec[v] + started(t)), where
        started(t) says that its recomputation ran at or before t and H(t) that it is held
        (save + rec) and its last reader runs at t or later. So: +s*save beyond the forward;
        +s*x[v,p] at each start slot; at each end, H steps down (`_held_until`)."""
        nf = self.problem.num_forward
        self.hge: dict[int, list[tuple[int, object]]] = {}
        self.direct_end: dict[int, int] = {}
        for v in self._candidates:
            self._tick()
            s = self._size[v]
            keep, again = self.save.get(v), self.rec.get(v)
            held = [x for x in (keep, again) if x is not None]
            if not s or not held:
                continue
            if keep is not None:
                self._event(max((r for r in self.readers[v] if r < nf), default=v) + 1, s, keep)
            if again is not None:
                self._recomputed_copy_events(v, s)
            self._held_until(v, s, held)

    def _event(self, t: int, coef: int, x) -> None:
        if t < self.slots and coef:
            self.events.setdefault(t, []).append((coef, x))

    def _recomputed_copy_events(self, v: int, s: int) -> None:
        """The recomputed copy starts at the slot of its position: +s * le[v,p] at p's slot,
        less the previous literal (which implies it), so that their running sum is
        s * started(t)."""
        previous = None
        t = tuple_of(self.problem, v)
        for p, lit in self.le[v].items():
            # A getitem's copy exists from the slot after its tuple op's (simulate).
            made = self.slot_of[(p, v)] if t is None else self.slot_of[(p, t)] + 1
            self._event(made, s, lit)
            if previous is not None:
                self._event(made, -s, previous)
            previous = lit

    def _held_until(self, v: int, s: int, held: list) -> None:
        """H(t): v is held up to its last direct backward reader; past that, the literal
        hge[v, c] for each later candidate end c (a recomputed reader's slot, or one a copy
        reading v may be fused into: `jit_fused`), bounded below by the reads that would run
        there. Each step of the chain ends the level before.

        A reader w bounds hge[v, c] only at the ends c that are w's own slots ("w runs at c
        or later"): at an end between two of w's slots that sum equals the one at w's next
        slot, whose literal implies this one, so repeating it would add nothing, in the LP
        either. (Bounding every end by every later reader, each found by a scan of its
        positions, was most of the build on a Llama-70B compiled problem of 17,586 ops: 503
        of 653 s under cProfile, 10.5 million constraints; now 23 of 115 s, 9.6 million.)"""
        m, slot_of = self.model, self.slot_of
        nf = self.problem.num_forward
        direct_end = max((self.op_slot[r] for r in self.readers[v] if r >= nf), default=None)
        # Per end slot, the reads that may run there: the literal of the read (a recomputed
        # reader w, or a copy fused into that slot whose reads of v move there), with the
        # literal "w runs before that slot" (None: it never does, or a moved read).
        runs_at: dict[int, list[tuple[object, object]]] = {}
        for w in self.readers[v]:
            if w in self.rec:
                earlier = None
                for p, lit in self.le[w].items():  # in increasing slot order
                    runs_at.setdefault(slot_of[(p, w)], []).append((self.rec[w], earlier))
                    earlier = lit
        for t, fused in self.fusion.reads.get(v, ()):
            runs_at.setdefault(t, []).append((fused, None))
        ends = sorted(runs_at)
        if direct_end is None:
            direct_end = ends[0]  # held means some recomputed reader runs, at ends[0] or later
        self.direct_end[v] = direct_end
        chain = [(t, m.NewBoolVar(f"hge[{v},{t}]")) for t in ends if t > direct_end]
        self.hge[v] = chain
        level_now, end_now = held, direct_end
        for t, lit in chain:
            for x in level_now:
                self._event(end_now + 1, -s, x)
            self._event(end_now + 1, s, lit)
            if level_now is not held:
                m.AddImplication(lit, level_now[0])
            else:
                m.Add(lit <= sum(held))
            for read, earlier in runs_at[t]:
                # w recomputed with its slot at t or later: rec[w] - le[w, last slot < t].
                if earlier is not None:
                    m.Add(lit >= read - earlier)
                else:
                    m.AddImplication(read, lit)
            level_now, end_now = [lit], t
        for x in level_now:
            self._event(end_now + 1, -s, x)

    # --- Step 8, the memory chain.

    def _memory_chain(self) -> None:
        """decided[t] = decided[t-1] + events at t, and at each slot decided + fixed + the temp
        of a recomputation running there <= peak. A slot where nothing rises needs no bound:
        the slot before bounds it."""
        m = self.model
        total = sum(self._size) + sum(self._temp) + 1
        self.peak = m.NewIntVar(self.fixed_peak, max(total, self.fixed_peak), "peak")
        self.temp_at = self._recomputation_temps()
        self.decided = memory_chain(m, self.events, self.temp_at, self.fixed, self.slots, total,
                                    self.peak, self._tick)

    def _recomputation_temps(self) -> dict[int, list[tuple[int, object]]]:
        """The temp of a recomputation at the sub-slot of its position: temp * (le[v,p] - the
        previous literal), which is 1 at exactly the position it runs at."""
        temp = self._temp
        temp_at: dict[int, list[tuple[int, object]]] = {}
        for v in self.rec:
            if temp[v]:
                previous = None
                for p, lit in self.le[v].items():
                    earlier = [(-temp[v], previous)] if previous is not None else []
                    temp_at[self.slot_of[(p, v)]] = [(temp[v], lit)] + earlier
                    previous = lit
        return temp_at

    # --- Reading and hinting solutions.

    def decision(self, value) -> tuple[set[int], None]:
        return {v for v, x in self.rec.items() if value(x)}, None

    def hint(self, schedule: Schedule) -> None:
        """Hint every variable from `schedule`, re-placed just in time (`jit_hint.hint`)."""
        hint(self, schedule)
