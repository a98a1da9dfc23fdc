"""The CP-SAT model of the eager execution mode (`remat.solvers.timeline.eager`): which ops each
block's selective-checkpoint policy caches, solved exactly against `eager_timeline`. See
`EagerModel`.
"""
from __future__ import annotations

from dataclasses import dataclass

from ortools.sat.python import cp_model

from remat.solvers.eager.decisions import TRUE, EagerDecisions, check_structure, negated
from remat.solvers.cpsat.units import Profile, Units
from remat.solvers.core.deadline import Deadline, ticker
from remat.solvers.timeline.eager import EagerBlocks, block_runs
from remat.solvers.core.problem import Kind, Problem, recompute_blocker, tuple_of


@dataclass
class _Hold:
    """A storage held from slot `start` while `presence` holds, to the latest of `terms`: (slot,
    literals that must all hold for the storage to be held to that slot)."""

    size: int
    start: int
    presence: object  # TRUE or a literal
    terms: list


class EagerModel(EagerDecisions):
    """The eager mode's decisions are one boolean per *cache unit*: a cacheable op, or the
    tensors of one multi-output op (`EagerBlocks.groups`), which a policy caches together.
    Everything else follows from them (`block_runs`): a block's trigger, early stop and end do
    not depend on what it caches, and the block recomputes exactly the ops it recomputes with
    nothing cached (`P`) less the cached ones, and less the tuple ops whose tensors are all
    cached (checkpoint does not run such a call again). A unit none of whose ops is in P, nor
    a tensor of a tuple op of P whose tensors may all be cached, gets no boolean: caching it
    saves no recomputation and only holds its tensors longer.

    Time is the step order with every op of P recomputed (`eager_timeline`'s order under the
    empty cache): forward ops, then per backward op the recomputations its block runs there
    (in forward order), then the op. A recomputation slot is a step only when its op is not
    cached; the memory at an empty slot is a subset of the next step's, because every storage
    is held to a slot that runs (the terms below are steps, or, for "held until the
    recomputation starts", the chain `_first_running`), so the model may check every slot.

    Each storage is one or two holds (`eager_timeline`'s original and recomputed copy): a
    start, a presence literal, and the candidate last slots with the literals under which each
    applies. As in `JitModel`, memory is a chain of events on the slots, and "held to candidate
    slot e or later" is a literal bounded below by the terms at e (and above by the next one),
    so the model's bytes never understate the timeline's and are exactly its own for the least
    values of those literals: the least cost is exact, and `peak_of` gives the timeline's
    peak of a decision from the model's own holds (tests check it against `eager_schedule`).

    It follows every rule of `eager_timeline`: checkpoint's frame (a block's inputs, its ops
    that cannot be recomputed, cached values the recomputation stops before, the generator's
    snapshot) holds to the end of the autograd node of the block's last read; a cached value
    the recomputation takes out is held by the block's Python variables to the last running
    recomputation up to its `forward_life`; a backward value to the end of its readers' nodes
    (within a node written in Python, `python_backward`, to the reader itself); fork_rng's copy
    of the generator's state at each running recomputation step; an unread input from its
    first caller's forward to its last caller's end; a kept number and an unused tensor at
    their fixed forward slots and at their block's running recomputation steps after them."""

    def __init__(self, problem: Problem, blocks: EagerBlocks, units: Units,
                 deadline: Deadline | None = None):
        """OutOfTime when `deadline` passes while the model is built (DBRX's: 1.5 to 4.5 s
        under a load of 7, where the limit was 3.5 s)."""
        self.problem, self.blocks, self.units = problem, blocks, units
        tick = ticker(deadline, "eager: building the model")
        ops, nf = problem.ops, problem.num_forward
        m = self.model = cp_model.CpModel()
        size, temp = units.sizes(problem)
        check_structure(problem, blocks)

        # --- Step 1: the runs with nothing cached; P, what each block may recompute.
        self.runs = runs = block_runs(problem, blocks, ())
        run_of = {v: run for run in runs for v in blocks.ops[run.name]}
        may = {v: run for run in runs for v in run.recomputed}

        # --- Step 2: one boolean per cache unit that holds an op of P.
        unit_of: dict[int, tuple[int, ...]] = {}
        for group in blocks.groups:
            for v in group:
                unit_of[v] = tuple(group)
        units_of = {unit_of.get(v, (v,)) for v in blocks.cacheable}
        can_cache = {u for unit in units_of for u in unit}
        # A tensor taken out of a tuple op of P counts as in P when the policy may cache every
        # tensor of that op: caching them all skips the call (block_runs), even one past the
        # early stop that is itself never recomputed.
        skippable = {g for t in may if ops[t].kind is Kind.TUPLE and problem.users[t]
                     and can_cache.issuperset(problem.users[t]) for g in problem.users[t]}
        self.cache: dict[tuple[int, ...], object] = {}
        for unit in sorted(units_of):
            if any(u in may or u in skippable for u in unit):
                self.cache[unit] = m.NewBoolVar(f"cache[{ops[unit[0]].name}]")
        cached_lit = {u: x for unit, x in self.cache.items() for u in unit}
        self.decidable = frozenset(cached_lit)
        """The ops whose caching the model decides (cached together by units)."""
        # A recomputation runs unless its op is cached; a tuple op (never cached itself:
        # check_structure) unless every tensor taken out of it is (block_runs).
        self.runs_lit = {v: cached_lit[v].Not() if v in cached_lit else TRUE for v in may}
        self._some_uncached: list[tuple[object, list]] = []  # (rerun, its units' literals)
        for t in (v for v in may if ops[v].kind is Kind.TUPLE and problem.users[v]):
            if all(g in cached_lit for g in problem.users[t]):
                lits = list({cached_lit[g].Index(): cached_lit[g]
                             for g in problem.users[t]}.values())
                rerun = m.NewBoolVar(f"runs[{ops[t].name}]") if lits[1:] else lits[0].Not()
                if lits[1:]:  # runs exactly when some unit is not cached
                    m.AddBoolOr([x.Not() for x in lits]).OnlyEnforceIf(rerun)
                    m.AddBoolAnd(lits).OnlyEnforceIf(rerun.Not())
                    self._some_uncached.append((rerun, lits))
                self.runs_lit[t] = rerun

        # --- Step 3: the slots.
        slot = list(range(nf)) + [0] * (len(ops) - nf)
        again: dict[int, int] = {}
        self.active: list = [TRUE] * nf
        at_trigger = {run.trigger: run for run in runs if run.trigger is not None}
        for b in problem.backward:
            run = at_trigger.get(b)
            for v in sorted(run.recomputed) if run is not None else ():
                again[v] = len(self.active)
                self.active.append(self.runs_lit[v])
            slot[b] = len(self.active)
            self.active.append(TRUE)
        self.slots, self.again = len(self.active), again
        self._bools: dict[int, object] = {x.Index(): x for x in [
            *self.cache.values(), *(runs for runs, _ in self._some_uncached)]}
        self._none: dict[tuple[int, int], object] = {}  # _first_running's chain literals
        self._none_defs: list[tuple[object, object, object]] = []
        node_end = blocks.node_end

        def read_at(r: int) -> int:  # eager autograd frees a node's tensors when it ends
            return slot[node_end.get(r, r)]

        def first_running(start: int, lits: list) -> list:
            """Terms that hold a storage to the first slot from `start` that runs."""
            return [(k, lits + ([none] if none is not TRUE else []))
                    for k, none in self._first_running(start)]

        # --- Step 4: what checkpoint itself holds (eager_timeline's held_to), by storage:
        # to the end of the autograd node of the block's last read (checkpoint's frame).
        finished = {run.name: read_at(run.end) for run in runs if run.end is not None}
        held: dict[int, list] = {}
        for run in runs:
            if run.end is None:
                continue
            kept = list(run.inputs) + [v for v in blocks.ops[run.name] if ops[v].kind is not
                                       Kind.VIEW and recompute_blocker(problem, v) is not None]
            for s in kept:
                held.setdefault(s, []).append((finished[run.name], []))
        for unit, x in self.cache.items():
            for v in unit:
                run = run_of.get(v)
                if run is None or run.end is None:
                    continue
                if v > run.stop:  # the recomputation stops before it: held to the block's end
                    held.setdefault(v, []).append((finished[run.name], [x]))
                    continue
                # The cache gives it to the recomputation, at its first step; then the block's
                # Python variables hold it as in the forward (`forward_life`), to the last
                # recomputation that runs before the op they held it to.
                first = again[min(run.recomputed)] if run.recomputed else slot[run.trigger]
                lives_to = blocks.forward_life.get(v, -1)
                held.setdefault(v, []).extend(first_running(first, [x]) + [
                    (again[u], [x, self.runs_lit[u]]) for u in run.recomputed
                    if u <= lives_to and u not in unit])

        # --- Step 5: the holds (eager_timeline's, slot for step).
        holds: list[_Hold] = []
        pairs: list[tuple[int, list]] = []  # (original's hold, its copy's next) and the reads
        readers, pinned = problem.storage_readers, problem.pinned
        for i, op in enumerate(ops):
            tick()
            if problem.root[i] != i or op.size == 0:
                continue
            t = tuple_of(problem, i)
            made = slot[i] if t is None else slot[t] + 1
            if i in pinned:
                holds.append(_Hold(size[i], made, TRUE, [(self.slots - 1, [])]))
                continue
            if i >= nf:  # eager_timeline's node_end and python_backward rules: fixed slots
                python = i in blocks.python_backward
                last = [(slot[r] if python and node_end.get(r, r) == node_end.get(i, i)
                         else read_at(r), []) for r in (i, *readers[i])]
                holds.append(_Hold(size[i], made, TRUE, last))
                continue
            run = run_of.get(i)
            block = run.name if run is not None else None
            rec = self.runs_lit.get(i)  # None: never recomputed
            original = [(made, [])] + held.get(i, [])
            copy: list = []
            lives_to = blocks.forward_life.get(i)
            if lives_to is not None:
                original.append((slot[lives_to], []))
                if rec is not None:
                    copy += [(again[v], [self.runs_lit[v]]) for v in run.recomputed
                             if v <= lives_to]
            for r in readers[i]:
                if r < nf:
                    original.append((slot[r], []))
                    if r in again:  # read again by a recomputation
                        lit = self.runs_lit[r]
                        if rec is not None and run_of.get(r) is run:
                            original.append((again[r], [lit, negated(rec)]))
                            copy.append((again[r], [lit]))
                        else:
                            original.append((again[r], [lit]))
                elif rec is not None and blocks.owner.get(r) == block:
                    original.append((read_at(r), [negated(rec)]))
                    copy.append((read_at(r), []))
                else:
                    original.append((read_at(r), []))
            holds.append(_Hold(size[i], made, TRUE, original))
            if rec is not None and rec is not TRUE:  # read by its block's recomputations:
                pairs.append((len(holds) - 1, [(again[r], self.runs_lit[r]) for r in readers[i]
                                               if r in again and run_of.get(r) is run]))
            if rec is not None:
                start = again[i] if t is None else again[t] + 1
                if not copy or t is not None:
                    # Made at the step after its tuple op's: the first slot from `start` that
                    # runs, which need not be its own when a sibling's is empty (cached).
                    copy += first_running(start, [])
                holds.append(_Hold(size[i], start, rec,
                                   [(k, lits + ([rec] if rec is not TRUE else []))
                                    for k, lits in copy]))
        state = units.bytes_up(blocks.state_bytes)
        for run in runs:
            if run.end is not None and state:  # checkpoint's generator snapshot
                first = slot[blocks.ops[run.name][0]]
                holds.append(_Hold(state, first, TRUE, [(finished[run.name], [])]))
        for amount, names in blocks.unread_inputs:  # fixed: first forward to the last end
            ends = [finished[n] for n in names if n in finished]
            if ends:
                first = min(slot[blocks.ops[n][0]] for n in names)
                holds.append(_Hold(units.bytes_up(amount), first, TRUE, [(max(ends), [])]))
        for amount, v, b in blocks.kept_numbers:  # fixed: after the op to its node's end
            holds.append(_Hold(units.bytes_up(amount), slot[v] + 1, TRUE, [(read_at(b), [])]))
        for amount, first, last, _ in blocks.unused_tensors:  # fixed: first to last op
            holds.append(_Hold(units.bytes_up(amount), slot[first], TRUE, [(slot[last], [])]))
        for h in holds:  # a literal that always holds says nothing; one that never does, drops
            h.terms = [(k, [x for x in lits if x is not TRUE]) for k, lits in h.terms
                       if not any(x is False for x in lits)]
        self.holds = holds

        # --- Step 6: the fixed profile, and the events of what the decisions move.
        profile = Profile()
        temp_at: dict[int, list] = {}
        for i in range(len(ops)):
            profile.hold(temp[i], slot[i], slot[i])
        # A recomputation step holds its temp, and on the CPU fork_rng's copy of the
        # generator's state (kept while the block's recomputation runs, its steps only).
        forked = {v for run in runs if run.trigger is not None for v in run.recomputed}
        # And the Python numbers that the recomputed graph keeps, from their op on: at each
        # recomputation step after it (eager_holds: to the recomputation's end); so do the
        # unused tensors made in a block, from their first op's recomputation on.
        numbers: dict[int, int] = {}
        remade = [(amount, v, v) for amount, v, _ in blocks.kept_numbers] + [
            (amount, first, first - 1) for amount, first, _, in_block in blocks.unused_tensors
            if in_block]
        for amount, v, after in remade:
            for u in run_of[v].recomputed if v in run_of else ():
                if u > after:
                    numbers[u] = numbers.get(u, 0) + units.bytes_up(amount)
        for v, k in again.items():
            amount = temp[v] + (state if v in forked else 0) + numbers.get(v, 0)
            if amount:
                if self.runs_lit[v] is TRUE:
                    profile.hold(amount, k, k)
                else:
                    temp_at[k] = [(amount, self.runs_lit[v])]
        events: dict[int, list] = {}

        def event(t: int, coef: int, x) -> None:
            if t < self.slots and coef:
                events.setdefault(t, []).append((coef, x))

        self.ends: list[list[tuple[int, object]]] = []  # per hold: (candidate end, literal)
        for h in holds:
            tick()
            fixed_end = max([h.start] + [k for k, lits in h.terms if not lits])
            moving = sorted({k for k, lits in h.terms if lits and k > fixed_end})
            if h.presence is TRUE:
                profile.hold(h.size, h.start, fixed_end)
            else:
                event(h.start, h.size, h.presence)
                event(fixed_end + 1, -h.size, h.presence)
            ends = [(k, m.NewBoolVar(f"held[{k}]")) for k in moving]
            self._bools.update((x.Index(), x) for _, x in ends)
            self.ends.append(ends)
            previous_end, previous = fixed_end, h.presence
            for k, x in ends:
                event(previous_end + 1, h.size, x)
                event(k + 1, -h.size, x)
                if previous is not TRUE:
                    m.AddImplication(x, previous)
                previous_end, previous = k, x
            at = dict(ends)
            for k, lits in h.terms:
                if k in at:  # held to k when every literal holds (and to what is before)
                    m.Add(at[k] >= sum(lits) - (len(lits) - 1))
        # A storage that a recomputation reads is held there, by the original or the copy:
        # implied, but the LP sees it only in sum (each term alone is a conjunction).
        self.pairs = pairs
        for index, reads in pairs:
            for k, lit in reads:
                either = [self._held_at(index, k), self._held_at(index + 1, k)]
                m.Add(sum(x for x in either if x is not TRUE) + sum(x is TRUE for x in either)
                      >= lit)
        self.fixed = profile.levels(self.slots)
        self.fixed_peak = max(self.fixed, default=0)

        # --- Step 7: the memory chain and the peak, checked wherever something rises.
        total = sum(h.size for h in holds) + sum(temp) + 1
        self.peak = m.NewIntVar(self.fixed_peak, max(total, self.fixed_peak), "peak")
        self.events, self.temp_at, self.decided = events, temp_at, []
        level = 0
        for t in range(self.slots):
            tick()
            change = events.get(t)
            if change:
                current = m.NewIntVar(0, total, f"decided[{t}]")
                m.Add(current == level + sum(c * x for c, x in change))
                level = current
            self.decided.append(level)
            if change or t in temp_at or t == 0 or self.fixed[t] > self.fixed[t - 1]:
                m.Add(level + self.fixed[t] + sum(c * x for c, x in temp_at.get(t, ()))
                      <= self.peak)
        moving = [(v, lit) for v, lit in self.runs_lit.items() if lit is not TRUE]
        self.cost = cp_model.LinearExpr.WeightedSum(
            [lit for _, lit in moving], [units.cost_of(ops[v].cost) for v, _ in moving])
        self.fixed_cost = sum(ops[v].cost for v, lit in self.runs_lit.items() if lit is TRUE)

    def _held_at(self, index: int, k: int):
        """The literal "hold `index` is held at slot k" (TRUE, a literal, or 0)."""
        h = self.holds[index]
        if k <= max([h.start] + [e for e, lits in h.terms if not lits]):
            return h.presence
        later = [x for e, x in self.ends[index] if e >= k]
        return later[0] if later else 0

    def _first_running(self, start: int) -> list[tuple[int, object]]:
        """(slot k, "no slot from `start` before k runs") for k from `start` to the first slot
        that always runs: a storage held to the first step from `start` is held to k under
        that literal (an empty slot it is then held over is followed by one it is held at)."""
        out, none = [], TRUE
        for k in range(start, self.slots):
            out.append((k, none))
            runs = self.active[k]
            if runs is TRUE:
                return out
            key = (start, k)
            if key not in self._none:
                m = self.model
                x = m.NewBoolVar(f"none_running[{start},{k}]")
                self._bools[x.Index()] = x
                self._none_defs.append((x, none, runs))
                # x = none and not runs
                m.AddImplication(x, runs.Not())
                if none is not TRUE:
                    m.AddImplication(x, none)
                    m.AddBoolOr([x, none.Not(), runs])
                else:
                    m.AddBoolOr([x, runs])
                self._none[key] = x
            none = self._none[key]
        return out


__all__ = ["EagerModel"]
