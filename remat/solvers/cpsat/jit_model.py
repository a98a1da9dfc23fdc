"""The CP-SAT model with just-in-time recompute positions (`free_positions=False`; DESIGN.md's
rule and make_schedule's default): the decisions are the booleans alone. See `JitModel`.
"""
from __future__ import annotations

from ortools.sat.python import cp_model

from remat.solvers.cpsat.units import Units, in_model_space, provide_what_is_needed
from remat.solvers.core.deadline import Deadline, ticker
from remat.solvers.core.problem import Kind, Problem, recompute_blocker, tuple_of
from remat.solvers.core.schedule import Schedule
from remat.solvers.timeline.evaluate import make_schedule


class JitModel:
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

    def __init__(self, problem: Problem, units: Units, deadline: Deadline | None = None):
        """OutOfTime when `deadline` passes while the model is built."""
        self.problem, self.units = problem, units
        tick = ticker(deadline, "building the model")
        ops, nf = problem.ops, problem.num_forward
        readers = self.readers = problem.storage_readers
        pinned = problem.pinned
        m = self.model = cp_model.CpModel()
        size, temp = units.sizes(problem)
        candidates = [v for v in problem.candidates if v not in pinned]

        # --- Step 1, presolve: which candidates may be recomputed (as in FreeModel), and the
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
        provide_what_is_needed(m, problem, candidates, direct, self.save, self.rec, readers)

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
            tick()
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
            tick()
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
            tick()
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
        schedule = in_model_space(self.problem, schedule, self.rec)
        if schedule is None:
            return  # not a schedule of this model's space
        recomputed = set(schedule.recomputed)
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

