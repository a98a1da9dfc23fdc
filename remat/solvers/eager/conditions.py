"""The conditions under which a storage is held to a slot or later, for the slot relaxation
(`slots`), in few rows.

A storage's hold lists its candidate last slots with the literals that must all hold for it
to be held there (`EagerModel.holds`). At a checked slot t, the relaxation's boolean "held to
t or later" is bounded below by every term at t or later: one row per term, about 190 for a
cached value of a Mamba block (Bamba: 47,000 rows at five slots, 90,000 at seven, each round
of CP-SAT on them 1 to 22 s). Almost all of them are two shapes, each a row per slot of a
recomputation:

- "x and the recomputation at k runs" (a cached value held by the block's Python variables
  to the last recomputation that runs): their disjunction is "x and some recomputation of
  an interval of slots runs", one row on a shared "some slot from c to e runs" boolean (a
  chain per start c: at least each slot's literal and the one before), which is exactly as
  strong, for whole policies and in the linear relaxation alike;
- "x and no slot from s before k runs" (held to the first slot from s that runs): the
  earliest k implies the later ones (the "none" literals fall along the chain, in the
  relaxation as in the model), so it alone stays.

A term whose literals include another term's lone literal is implied by that term, and dropped.
"""
from __future__ import annotations

from remat.solvers.eager.decisions import TRUE


class HeldConditions:
    """`of(i, t)`: the conditions (lists of relaxation literals, each held together) whose
    disjunction is exactly the model's "hold i is held to t or later", with the "some slot
    runs" booleans they need added to `m` (shared between storages and slots)."""

    def __init__(self, model, lit, m):
        self.full, self._lit, self.m = model, lit, m
        # The start s of each "no slot from s before k runs" literal (`_first_running`).
        self._none_start = {x.Index(): start for (start, _), x in model._none.items()}
        self._chains: dict[int, list] = {}  # start slot c -> "some slot from c to c + j runs"
        self.some_running: dict[int, tuple[int, int]] = {}  # its boolean's index -> (c, e)
        # Literals' indices read once: `of` runs per storage and slot (Bamba: 0.7 of 9 s in
        # CP-SAT's Index calls before).
        self._active_ref = [None if x is TRUE else x.Index() for x in model.active]
        self._term_refs: dict[int, list] = {}

    def _terms(self, i: int) -> list[tuple]:
        """Hold i's terms with conditions: (slot, literals, their indices, those as a set)."""
        if i not in self._term_refs:
            terms = []
            for k, lits in self.full.holds[i].terms:
                if lits:
                    refs = tuple(x.Index() for x in lits)
                    terms.append((k, lits, refs, frozenset(refs)))
            self._term_refs[i] = terms
        return self._term_refs[i]

    def of(self, i: int, t: int) -> list[list]:
        terms = [term for term in self._terms(i) if term[0] >= t]
        lone = {refs[0] for _, _, refs, _ in terms if len(refs) == 1}
        seen, kept = set(), []
        for k, lits, refs, key in terms:
            if key in seen or (len(refs) > 1 and lone.intersection(key)):
                continue  # the same condition again, or implied by a lone literal's
            seen.add(key)
            kept.append((k, lits, refs))
        earliest: dict[tuple[int, int], tuple[int, list]] = {}
        running: dict[int, tuple[object, set[int]]] = {}
        out = []
        for k, lits, refs in kept:
            if len(lits) == 2:
                for x, rx, rn in ((lits[0], refs[0], refs[1]), (lits[1], refs[1], refs[0])):
                    if rn in self._none_start:
                        key = (rx, self._none_start[rn])
                        if key not in earliest or k < earliest[key][0]:
                            earliest[key] = (k, lits)
                        break
                    if rn == self._active_ref[k]:
                        running.setdefault(rx, (x, set()))[1].add(k)
                        break
                else:
                    out.append([self._lit(x) for x in lits])
                continue
            out.append([self._lit(x) for x in lits])
        out += [[self._lit(x) for x in lits] for _, lits in earliest.values()]
        for x, slots in running.values():
            out += [[self._lit(x), some] for some in self._intervals(x, slots)]
        return out

    def _intervals(self, x, slots: set[int]) -> list:
        """Booleans whose disjunction, with x, is that of "x and the slot k runs" over
        `slots`: each "some slot of an interval runs" where the interval's other slots are
        x's own negation (a slot that runs only where x does not: with x, it never holds)."""
        active, out = self.full.active, []
        todo = sorted(slots)
        not_x = -x.Index() - 1
        while todo:
            c = todo[0]
            e = c
            while (e + 1 < len(active) and active[e + 1] is not TRUE
                   and (e + 1 in slots or active[e + 1].Index() == not_x)):
                e += 1
            out.append(self._some_running(c, e))
            todo = [k for k in todo if k > e]
        return out

    def _some_running(self, c: int, e: int):
        """The relaxation's boolean bounded below by each slot's literal from c to e (every
        one a recomputation's, none TRUE): "some slot from c to e runs"."""
        chain = self._chains.setdefault(c, [self._lit(self.full.active[c])])
        while len(chain) <= e - c:
            j = c + len(chain)
            y = self.m.NewBoolVar(f"some_running[{c},{j}]")
            self.m.Add(y >= chain[-1])
            self.m.Add(y >= self._lit(self.full.active[j]))
            chain.append(y)
            self.some_running[y.Index()] = (c, j)
        return chain[e - c]
