"""The CP-SAT model of the eager execution mode (`remat.solvers.timeline.eager`): which ops each
block's selective-checkpoint policy caches, solved exactly against `eager_timeline`. See
`EagerModel`.
"""
from __future__ import annotations

from ortools.sat.python import cp_model

from remat.solvers.eager.decisions import TRUE, EagerDecisions, check_structure
from remat.solvers.eager.storage import StorageHolds
from remat.solvers.cpsat.units import Profile, Units, memory_chain
from remat.solvers.core.deadline import Deadline, ticker
from remat.solvers.timeline.eager_blocks import EagerBlocks, block_runs
from remat.solvers.core.problem import Kind, Problem


class EagerModel(StorageHolds, EagerDecisions):
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
    that cannot be recomputed and are not cached, cached values the recomputation stops
    before, the generator's snapshot) holds to the end of the autograd node of the block's
    last read; a cached value the recomputation takes out is held by the block's Python
    variables to the last running recomputation up to its `forward_life` (the routing
    decisions every policy caches, `always_cached`, as cached under every decision); a
    backward value to the end of its readers' nodes (within a node written in Python,
    `python_backward`, to the reader itself); fork_rng's copy of the generator's state at
    each running recomputation step; an unread input from its first caller's forward to its
    last caller's end; a kept number and an unused tensor at their fixed forward slots and at
    their block's running recomputation steps after them."""

    def __init__(self, problem: Problem, blocks: EagerBlocks, units: Units,
                 deadline: Deadline | None = None, *, complete: bool = True):
        """OutOfTime when `deadline` passes while the model is built (DBRX's: 1.5 to 4.5 s
        under a load of 7, where the limit was 3.5 s). `complete=False` leaves out what only
        a solve of the whole model reads, until `complete()`: the slot relaxation
        (`remat.solvers.eager.slots`) reads the holds, events and literals alone."""
        self.problem, self.blocks, self.units = problem, blocks, units
        self._tick = ticker(deadline, "eager: building the model")
        self.model = cp_model.CpModel()
        size, temp = units.sizes(problem)
        check_structure(problem, blocks)
        may = self._runs_with_nothing_cached()
        self._cache_booleans(may)
        self._slots()
        held, finished = self._checkpoint_holds()
        self._holds(size, held, finished)
        profile, self.temp_at = self._fixed_profile(temp)
        self.events = self._hold_events(profile)
        self.fixed = profile.levels(self.slots)
        self.fixed_peak = max(self.fixed, default=0)
        self._total = sum(h.size for h in self.holds) + sum(temp) + 1
        self._cost()
        self.completed = False
        if complete:
            self.complete()

    def complete(self, deadline: Deadline | None = None) -> None:
        """The rows only a solve of the whole model reads: the chains of "held to candidate
        slot e or later" literals and their lower bounds, the pair rows, the memory chain and
        the peak. Gemma-2-9B's 14,276 ops: 509,000 of the model's 519,000 rows, built only
        where the slot relaxation left the search over every slot to run. OutOfTime
        when `deadline` passes first (the model is then unusable)."""
        if self.completed:
            return
        if deadline is not None:
            self._tick = ticker(deadline, "eager: completing the model")
        self._end_rows()
        self._pair_rows()
        self._memory_chain()
        self.completed = True

    def _runs_with_nothing_cached(self) -> dict:
        """Step 1: the runs with nothing cached (`runs`, and each op's run); P, what each
        block may recompute (by op: its run)."""
        self.runs = runs = block_runs(self.problem, self.blocks, ())
        self._run_of = {v: run for run in runs for v in self.blocks.ops[run.name]}
        return {v: run for run in runs for v in run.recomputed}

    def _cache_booleans(self, may: dict) -> None:
        """Step 2: one boolean per cache unit that holds an op of P (`cache`), and the literal
        under which each recomputation of P runs (`runs_lit`)."""
        problem, blocks, ops, m = self.problem, self.blocks, self.problem.ops, self.model
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
        self._runs_literals(may, cached_lit)

    def _runs_literals(self, may: dict, cached_lit: dict) -> None:
        """A recomputation runs unless its op is cached; a tuple op (never cached itself:
        check_structure) unless every tensor taken out of it is (block_runs)."""
        problem, ops, m = self.problem, self.problem.ops, self.model
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

    def _slots(self) -> None:
        """Step 3: the slots: each op's (`_slot`), each recomputation's (`again`), and whether
        each runs (`active`)."""
        problem, nf = self.problem, self.problem.num_forward
        slot = list(range(nf)) + [0] * (len(problem.ops) - nf)
        again: dict[int, int] = {}
        self.active: list = [TRUE] * nf
        at_trigger = {run.trigger: run for run in self.runs if run.trigger is not None}
        for b in problem.backward:
            run = at_trigger.get(b)
            for v in sorted(run.recomputed) if run is not None else ():
                again[v] = len(self.active)
                self.active.append(self.runs_lit[v])
            slot[b] = len(self.active)
            self.active.append(TRUE)
        self.slots, self.again, self._slot = len(self.active), again, slot
        self._bools: dict[int, object] = {x.Index(): x for x in [
            *self.cache.values(), *(runs for runs, _ in self._some_uncached)]}
        self._none: dict[tuple[int, int], object] = {}  # _first_running's chain literals
        self._none_defs: list[tuple[object, object, object]] = []

    def _fixed_profile(self, temp: list[int]) -> tuple[Profile, dict[int, list]]:
        """Step 6: the fixed profile (each op's temp at its slot), and the bytes of each
        recomputation step that runs under a literal (`temp_at`)."""
        blocks, units, slot, run_of = self.blocks, self.units, self._slot, self._run_of
        profile = Profile()
        temp_at: dict[int, list] = {}
        for i in range(len(self.problem.ops)):
            profile.hold(temp[i], slot[i], slot[i])
        # A recomputation step holds its temp, and on the CPU fork_rng's copy of the
        # generator's state (kept while the block's recomputation runs, its steps only).
        state = units.bytes_up(blocks.state_bytes)
        forked = {v for run in self.runs if run.trigger is not None for v in run.recomputed}
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
        for v, k in self.again.items():
            amount = temp[v] + (state if v in forked else 0) + numbers.get(v, 0)
            if amount:
                if self.runs_lit[v] is TRUE:
                    profile.hold(amount, k, k)
                else:
                    temp_at[k] = [(amount, self.runs_lit[v])]
        return profile, temp_at

    def _hold_events(self, profile: Profile) -> dict[int, list]:
        """The events of what the decisions move: per hold, its fixed part in `profile`, and
        a chain of "held to candidate slot e or later" literals (`ends`), each bounded below
        by the terms at e; by slot, the (coefficient, literal) changes they make."""
        m = self.model
        events: dict[int, list] = {}

        def event(t: int, coef: int, x) -> None:
            if t < self.slots and coef:
                events.setdefault(t, []).append((coef, x))

        self.ends: list[list[tuple[int, object]]] = []  # per hold: (candidate end, literal)
        for h in self.holds:
            self._tick()
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
            previous_end = fixed_end
            for k, x in ends:
                event(previous_end + 1, h.size, x)
                event(k + 1, -h.size, x)
                previous_end = k
        return events

    def _end_rows(self) -> None:
        """Each hold's chain of end literals implies the one before (and its presence), and
        each is bounded below by the terms that hold the storage to its slot."""
        m = self.model
        for h, ends in zip(self.holds, self.ends):
            self._tick()
            previous = h.presence
            for _, x in ends:
                if previous is not TRUE:
                    m.AddImplication(x, previous)
                previous = x
            at = dict(ends)
            for k, lits in h.terms:
                if k in at:  # held to k when every literal holds (and to what is before)
                    m.Add(at[k] >= sum(lits) - (len(lits) - 1))

    def _pair_rows(self) -> None:
        """A storage that a recomputation reads is held there, by the original or the copy:
        implied, but the LP sees it only in sum (each term alone is a conjunction)."""
        for index, reads in self.pairs:
            for k, lit in reads:
                either = [self._held_at(index, k), self._held_at(index + 1, k)]
                self.model.Add(sum(x for x in either if x is not TRUE)
                               + sum(x is TRUE for x in either) >= lit)

    def _memory_chain(self) -> None:
        """Step 7: the memory chain (`decided`, the level of what the decisions move, slot by
        slot) and the peak, checked wherever something rises."""
        m, total = self.model, self._total
        self.peak = m.NewIntVar(self.fixed_peak, max(total, self.fixed_peak), "peak")
        self.decided = memory_chain(m, self.events, self.temp_at, self.fixed, self.slots, total,
                                    self.peak, self._tick)

    def _cost(self) -> None:
        """The objective: the cost units of the recomputations that run under a literal
        (`cost`), and the seconds of those that always run (`fixed_cost`)."""
        ops, units = self.problem.ops, self.units
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
