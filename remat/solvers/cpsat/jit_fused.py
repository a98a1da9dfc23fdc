"""Recomputed copies a compiled step fuses into their reader, in the just-in-time model, as the
simulator counts them.

A value of `Problem.fused_recomputations` (a ReLU's mask, a SiLU's output: pointwise values
that Inductor computes inside the kernels reading them) whose recomputed copy serves one step
is no buffer: the simulator (`remat.solvers.timeline.simulate`) holds that copy at no bytes
and moves its reads of the value's input storages to that step, later values first, so that
a chain of such values fuses into one step and its first inputs live to it.

Which step a copy serves follows from the decision. Under the just-in-time rule a recomputed
value's reads are: each direct backward reader's step, and for each recomputed reader w, w's
own step where w is not fused, else the step w is fused into. So for each fusable value v and
each step t its copy could be fused into (`targets`), a literal fused[v, t] says "v is
recomputed and every read of it lands on t", both ways:

    fused[v, t] <=> rec[v] and, for every recomputable reader w of v: not rec[w], or
                    fused[w, t], or (w runs at t and w is not fused).

Every value fused into t is recomputed at t's backward op (its readers are all there), so its
copy's bytes are taken back from that recomputation to t, and each of its input storages gets
a read at t under the literal (`reads`): the model's held-until chain
(`JitModel._held_until`) then keeps the input to t unless something holds it longer, as the
simulator's moved read does, never counting it twice. With every fusable value encoded, the
model's bytes are the simulator's for every decision (`Fusion.exact`; tests/solvers/
test_jit_fused.py checks it against the simulator decision by decision), so what CP-SAT proves
on it holds.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from remat.solvers.core.problem import Kind, tuple_of

__all__ = ["Fusion", "fusion_of"]


@dataclass
class Fusion:
    """The fused-copy literals of a `JitModel`: `targets[v][t]` = fused[v, t]; `unfused_at[(w,
    t)]` = "w runs at slot t and is not fused" for the fusable w that may run at t; `reads[u]`
    the (slot, literal) reads moved onto u; `exact`: every fusable value is encoded (a tuple
    op or a tensor taken out of one is not: its copy is then counted as a buffer)."""

    targets: dict[int, dict[int, object]] = field(default_factory=dict)
    unfused_at: dict[tuple[int, int], object] = field(default_factory=dict)
    reads: dict[int, list[tuple[int, object]]] = field(default_factory=dict)
    exact: bool = True

    def fused(self, v: int):
        """The linear expression "v's copy is fused" (0 where it never is)."""
        return sum(self.targets.get(v, {}).values())


def fusion_of(model) -> Fusion:
    """Add the fused-copy literals of `model` (a `JitModel` whose slots and position literals
    are made), their constraints and the copies' events; return them (the reads moved onto
    input storages are for its held-until chains, built after this)."""
    problem, m = model.problem, model.model
    nf, size, readers = problem.num_forward, model._size, model.readers
    fusion = Fusion()
    op_at = {s: b for (b, _), s in model.slot_of.items()}
    op_at.update((model.op_slot[b], b) for b in problem.backward)
    for v in sorted(problem.fused_recomputations.intersection(model.rec), reverse=True):
        if problem.ops[v].kind is Kind.TUPLE or tuple_of(problem, v) is not None:
            fusion.exact = False
            continue
        direct = sorted({r for r in readers[v] if r >= nf})
        recomputable = sorted({w for w in readers[v] if w in model.rec})
        if len(direct) > 1:
            continue  # two steps read it: a buffer, as the simulator holds it
        if direct:
            targets = {model.op_slot[direct[0]]}
        else:
            targets = set()
            for w in recomputable:
                targets.update(_slots_of(model, w))
                targets.update(fusion.targets.get(w, ()))
        for t in sorted(targets):
            start = model.slot_of.get((op_at[t], v))
            if start is None:  # the rule puts every copy fused into t at t's op: never here
                fusion.exact = False
                continue
            literal = m.NewBoolVar(f"fused[{v},{t}]")
            fusion.targets.setdefault(v, {})[t] = literal
            _define(model, fusion, v, t, literal, recomputable, landing_required=not direct)
            model._event(start, -size[v], literal)
            model._event(t + 1, size[v], literal)
            for u in problem.storage_inputs[v]:
                if u < nf and u not in problem.pinned and size[u]:
                    fusion.reads.setdefault(u, []).append((t, literal))
        if v in fusion.targets:
            m.Add(fusion.fused(v) <= 1)
    return fusion


def _slots_of(model, w: int) -> dict[int, tuple[object, object]]:
    """The slots a recomputation of w may run at, each with the literals "w at or before its
    position" and "w at or before the position before" (None for the first)."""
    found, previous = {}, None
    for p, literal in model.le[w].items():
        found[model.slot_of[(p, w)]] = (literal, previous)
        previous = literal
    return found


def _define(model, fusion: Fusion, v: int, t: int, literal, recomputable: list[int],
            landing_required: bool) -> None:
    """literal <=> rec[v] and each recomputable reader w of v is not recomputed or lands on t
    (fused into t, or run at t unfused). The three cases of a reader exclude each other, so
    "w is fine" is their sum, linear. `landing_required`: v has no direct backward reader, so
    some recomputed reader must land on t (implied by the rest; stated for the LP)."""
    m, rec = model.model, model.rec
    m.AddImplication(literal, rec[v])
    fine_all, lands = [], []
    for w in recomputable:
        parts = []
        if t in fusion.targets.get(w, {}):
            parts.append(fusion.targets[w][t])
        at = _slots_of(model, w).get(t)
        if at is not None:
            parts.append(_unfused_at(model, fusion, w, t, at))
        fine = 1 - rec[w] + sum(parts)
        m.Add(literal <= fine)
        fine_all.append(fine)
        lands.extend(parts)
    if landing_required:
        m.Add(literal <= sum(lands))
    m.Add(literal >= rec[v] + sum(fine_all) - len(recomputable))


def _unfused_at(model, fusion: Fusion, w: int, t: int, at: tuple[object, object]):
    """"w runs at slot t and is not fused", as a literal where w may be fused, else the linear
    le[w, p] - le[w, p before]."""
    here, before = at
    runs = here - before if before is not None else here
    if w not in fusion.targets:
        return runs
    key = (w, t)
    if key not in fusion.unfused_at:
        m, fused = model.model, fusion.fused(w)
        x = m.NewBoolVar(f"unfused_at[{w},{t}]")
        m.AddImplication(x, here)
        if before is not None:
            m.AddImplication(x, before.Not())
        m.Add(x + fused <= 1)
        m.Add(x >= runs - fused)
        fusion.unfused_at[key] = x
    return fusion.unfused_at[key]
