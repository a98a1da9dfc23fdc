"""Recomputed copies a compiled step fuses into their reader, in the just-in-time model.

A value of `Problem.fused_recomputations` (a ReLU's mask, a SiLU's output: pointwise values
that Inductor computes inside the kernels reading them) recomputed for one op only is no
buffer: the simulator (`remat.solvers.timeline.simulate`) holds its copy at no bytes and holds
its inputs to that op instead. Counting the copy's bytes, the model saw less room than there
is and could undercount where an input outweighs the copy (the U-Net's 1 MiB ReLU output
held past its last other reader to the 0.25 MiB mask's reader).

Modelled here for a value with exactly one direct backward reader d (the copy then serves d
alone unless a reader of it is recomputed too, whose recomputation also reads it): the literal
`fused[v]` = v recomputed and no reader of it recomputed. Where it holds, the copy's bytes
are taken back over its life (from its recomputation just before d, to d) and each input
storage is held from there to d, unless a backward reader at or after d holds it anyway.
That input may already be held there by another recomputation placed before d: counted twice
then, which overstates memory and keeps the model's peak at or above the simulator's.

An input that is itself such a value and recomputed may be fused into d with it (the
simulator fuses the chain, holding the chain's first inputs to d): its inputs are held to d
too, under "both recomputations", and its own bytes stay counted, which overstates where the
simulator fuses it. Left counted as buffers: values with no direct backward reader or
several. The simulator fuses such a value where one recomputed reader is all it serves, and
holds its inputs to that reader: the model may then over- or understate, and the schedule
is judged by the simulator (`remat.solvers.solve` refuses one over the budget)."""
from __future__ import annotations

from dataclasses import dataclass

from remat.solvers.core.problem import tuple_of

__all__ = ["FusedCopy", "fused_copies"]


@dataclass(frozen=True)
class FusedCopy:
    """A value whose recomputed copy the model may hold at no bytes: its one direct
    backward reader, the literal, the readers whose recomputation would read it too, and
    the literals of the chain fused with it (`_hold_inputs`: each with its parent's literal
    and the input it says is recomputed, parents first)."""

    reader: int
    literal: object
    recomputed_readers: tuple[int, ...]
    chained: tuple[tuple[object, object, int], ...]


def fused_copies(model) -> dict[int, FusedCopy]:
    """Add each fusable value's literal and its events to `model` (a `JitModel` whose
    decided events are made); return them by value."""
    problem, m = model.problem, model.model
    free, nf = problem.fused_recomputations, problem.num_forward
    size, readers = model._size, model.readers
    found: dict[int, FusedCopy] = {}
    first_at: dict[int, int] = {}  # each backward op's first recomputation slot
    for (b, _), t in model.slot_of.items():
        first_at[b] = min(t, first_at.get(b, t))
    for v in sorted(free.intersection(model.rec)):
        direct = sorted({r for r in readers[v] if r >= nf})
        if len(direct) != 1 or not size[v] or tuple_of(problem, v) is not None:
            continue
        d = direct[0]
        again = tuple(w for w in readers[v] if w in model.rec)
        fused = m.NewBoolVar(f"fused[{v}]")
        m.AddImplication(fused, model.rec[v])
        for w in again:
            m.AddImplication(fused, model.rec[w].Not())
        m.Add(fused >= model.rec[v] - sum(model.rec[w] for w in again))
        model._event(model.slot_of[(d, v)], -size[v], fused)
        model._event(model.op_slot[d] + 1, size[v], fused)
        chained: list[tuple[object, object, int]] = []
        _hold_inputs(model, v, fused, d, first_at[d], {v}, chained)
        found[v] = FusedCopy(d, fused, again, tuple(chained))
    return found


def _hold_inputs(model, v: int, literal, d: int, first: int, seen: set[int],
                 chained: list) -> None:
    """Under `literal`, hold each forward input storage of v (recomputed just before d, or
    earlier) from v's recomputation to d, unless a backward reader at or after d holds it
    anyway; and, where that input is itself a free value recomputed, its inputs likewise."""
    problem, m, size = model.problem, model.model, model._size
    nf, read = problem.num_forward, model.op_slot[d]
    # v's recomputation, or the first at d where v runs earlier (then v serves two ops in
    # the simulator and holding from there only overstates).
    made = model.slot_of.get((d, v), first)
    # Its own inputs first: one reached again through a fused input is held already, under
    # this literal, which the deeper one implies.
    inputs = [u for u in problem.storage_inputs[v]
              if u < nf and u not in problem.pinned and u not in seen]
    seen.update(inputs)
    for u in inputs:
        if size[u] and not any(r >= d for r in model.readers[u] if r >= nf):
            model._event(made + 1, size[u], literal)
            model._event(read + 1, -size[u], literal)
    for u in inputs:
        if u in problem.fused_recomputations and u in model.rec:
            both = m.NewBoolVar(f"fused[{v}]&rec[{u}]")
            m.AddImplication(both, literal)
            m.AddImplication(both, model.rec[u])
            m.Add(both >= literal + model.rec[u] - 1)
            chained.append((both, literal, u))
            _hold_inputs(model, u, both, d, first, seen, chained)
