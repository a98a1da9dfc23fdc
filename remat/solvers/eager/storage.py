"""What each storage of the eager CP-SAT model (`EagerModel`, which builds on `StorageHolds`) is
held to, and under which of the model's literals: steps 4 and 5 of its construction.
"""
from __future__ import annotations

from dataclasses import dataclass

from remat.solvers.eager.decisions import TRUE, negated
from remat.solvers.core.problem import Kind, recompute_blocker, tuple_of


@dataclass
class _Hold:
    """A storage held from slot `start` while `presence` holds, to the latest of `terms`: (slot,
    literals that must all hold for the storage to be held to that slot)."""

    size: int
    start: int
    presence: object  # TRUE or a literal
    terms: list


class StorageHolds:
    """The holds of `EagerModel` (`holds`, `pairs`): a mixin, it reads the model's attributes
    made before these steps (`problem`, `blocks`, `units`, `runs`, `_run_of`, `cache`,
    `runs_lit`, `again`, `slots`, `_slot`, `_tick`) and its `_first_running` chain."""

    def _read_at(self, r: int) -> int:
        """The slot a read by op `r` holds its storage to: eager autograd frees a node's
        tensors when it ends."""
        return self._slot[self.blocks.node_end.get(r, r)]

    def _to_first_running(self, start: int, lits: list) -> list:
        """Terms that hold a storage to the first slot from `start` that runs."""
        return [(k, lits + ([none] if none is not TRUE else []))
                for k, none in self._first_running(start)]

    def _checkpoint_holds(self) -> tuple[dict[int, list], dict]:
        """Step 4: what checkpoint itself holds (eager_timeline's held_to), by storage: to the
        end of the autograd node of the block's last read (checkpoint's frame), the slot of
        which is each block's in `finished`."""
        problem, blocks, ops, slot = self.problem, self.blocks, self.problem.ops, self._slot
        finished = {run.name: self._read_at(run.end) for run in self.runs if run.end is not None}
        held: dict[int, list] = {}
        for run in self.runs:
            if run.end is None:
                continue
            kept = list(run.inputs) + [v for v in blocks.ops[run.name] if ops[v].kind is not
                                       Kind.VIEW and recompute_blocker(problem, v) is not None
                                       and v not in run.cached]
            for s in kept:
                held.setdefault(s, []).append((finished[run.name], []))
        # The routing decisions every policy caches (`always_cached`: the runs' cache with
        # nothing cached) are held as a cached unit whose literal always holds.
        units = [*self.cache.items(), *(((v,), TRUE) for run in self.runs for v in run.cached)]
        for unit, x in units:
            lit = [x] if x is not TRUE else []
            for v in unit:
                run = self._run_of.get(v)
                if run is None or run.end is None:
                    continue
                if v > run.stop:  # the recomputation stops before it: held to the block's end
                    held.setdefault(v, []).append((finished[run.name], lit))
                    continue
                # The cache gives it to the recomputation, at its first step; then the block's
                # Python variables hold it as in the forward (`forward_life`), to the last
                # recomputation that runs before the op they held it to.
                first = self.again[min(run.recomputed)] if run.recomputed else slot[run.trigger]
                lives_to = blocks.forward_life.get(v, -1)
                held.setdefault(v, []).extend(self._to_first_running(first, lit) + [
                    (self.again[u], [*lit, self.runs_lit[u]]) for u in run.recomputed
                    if u <= lives_to and u not in unit])
        return held, finished

    def _holds(self, size: list[int], held: dict[int, list], finished: dict) -> None:
        """Step 5: the holds (eager_timeline's, slot for step): each storage's (`holds`, and
        the `pairs` of an original and its copy that a recomputation reads), then the fixed
        ones."""
        holds: list[_Hold] = []
        pairs: list[tuple[int, list]] = []  # (original's hold, its copy's next) and the reads
        problem, slot, nf = self.problem, self._slot, self.problem.num_forward
        readers, pinned, node_end = problem.storage_readers, problem.pinned, self.blocks.node_end
        for i, op in enumerate(problem.ops):
            self._tick()
            if problem.root[i] != i or op.size == 0:
                continue
            t = tuple_of(problem, i)
            made = slot[i] if t is None else slot[t] + 1
            if i in pinned:
                holds.append(_Hold(size[i], made, TRUE, [(self.slots - 1, [])]))
            elif i >= nf:  # eager_timeline's node_end and python_backward rules: fixed slots
                python = i in self.blocks.python_backward
                last = [(slot[r] if python and node_end.get(r, r) == node_end.get(i, i)
                         else self._read_at(r), []) for r in (i, *readers[i])]
                holds.append(_Hold(size[i], made, TRUE, last))
            else:
                self._forward_holds(i, t, made, size[i], held.get(i, []), holds, pairs)
        self._fixed_holds(holds, finished)
        for h in holds:  # a literal that always holds says nothing; one that never does, drops
            h.terms = [(k, [x for x in lits if x is not TRUE]) for k, lits in h.terms
                       if not any(x is False for x in lits)]
        self.holds, self.pairs = holds, pairs

    def _forward_holds(self, i: int, t: int | None, made: int, size: int, held: list,
                       holds: list[_Hold], pairs: list) -> None:
        """Forward storage `i`'s original (to its reads, and to what checkpoint holds it to,
        `held`) and, where it may be recomputed, its copy; the reads of a recomputation of
        its block go to the copy where the op is recomputed."""
        again, slot, runs_lit = self.again, self._slot, self.runs_lit
        run = self._run_of.get(i)
        block = run.name if run is not None else None
        rec = runs_lit.get(i)  # None: never recomputed
        original = [(made, [])] + held
        copy: list = []
        lives_to = self.blocks.forward_life.get(i)
        if lives_to is not None:
            original.append((slot[lives_to], []))
            if rec is not None:
                copy += [(again[v], [runs_lit[v]]) for v in run.recomputed if v <= lives_to]
        for r in self.problem.storage_readers[i]:
            if r < self.problem.num_forward:
                original.append((slot[r], []))
                if r in again:  # read again by a recomputation
                    lit = runs_lit[r]
                    if rec is not None and self._run_of.get(r) is run:
                        original.append((again[r], [lit, negated(rec)]))
                        copy.append((again[r], [lit]))
                    else:
                        original.append((again[r], [lit]))
            elif rec is not None and self.blocks.owner.get(r) == block:
                original.append((self._read_at(r), [negated(rec)]))
                copy.append((self._read_at(r), []))
            else:
                original.append((self._read_at(r), []))
        holds.append(_Hold(size, made, TRUE, original))
        if rec is not None and rec is not TRUE:  # read by its block's recomputations:
            pairs.append((len(holds) - 1, [(again[r], runs_lit[r])
                                           for r in self.problem.storage_readers[i]
                                           if r in again and self._run_of.get(r) is run]))
        if rec is not None:
            start = again[i] if t is None else again[t] + 1
            if not copy or t is not None:
                # Made at the step after its tuple op's: the first slot from `start` that
                # runs, which need not be its own when a sibling's is empty (cached).
                copy += self._to_first_running(start, [])
            holds.append(_Hold(size, start, rec, [(k, lits + ([rec] if rec is not TRUE else []))
                                                  for k, lits in copy]))

    def _fixed_holds(self, holds: list[_Hold], finished: dict) -> None:
        """The holds no decision moves: checkpoint's generator snapshot, the unread inputs,
        the kept numbers and the unused tensors, at their fixed slots."""
        blocks, units, slot = self.blocks, self.units, self._slot
        state = units.bytes_up(blocks.state_bytes)
        for run in self.runs:
            if run.end is not None and state:  # checkpoint's generator snapshot
                first = slot[blocks.ops[run.name][0]]
                holds.append(_Hold(state, first, TRUE, [(finished[run.name], [])]))
        for amount, names in blocks.unread_inputs:  # fixed: first forward to the last end
            ends = [finished[n] for n in names if n in finished]
            if ends:
                first = min(slot[blocks.ops[n][0]] for n in names)
                holds.append(_Hold(units.bytes_up(amount), first, TRUE, [(max(ends), [])]))
        for amount, v, b in blocks.kept_numbers:  # fixed: after the op to its node's end
            holds.append(_Hold(units.bytes_up(amount), slot[v] + 1, TRUE,
                               [(self._read_at(b), [])]))
        for amount, first, last, _ in blocks.unused_tensors:  # fixed: first to last op
            holds.append(_Hold(units.bytes_up(amount), slot[first], TRUE, [(slot[last], [])]))
