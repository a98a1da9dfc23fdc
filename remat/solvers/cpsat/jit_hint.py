"""Hinting the just-in-time model (`jit_model.JitModel`) from a schedule: every variable, the
schedule re-placed just in time, so that CP-SAT starts from it as a solution."""
from __future__ import annotations

from remat.solvers.cpsat.units import in_model_space
from remat.solvers.core.schedule import Schedule
from remat.solvers.timeline.evaluate import make_schedule
from remat.solvers.timeline.simulate import StepKind, copies_of, step_order


def hint(model, schedule: Schedule) -> None:
    """Hint every variable of `model` from `schedule`, re-placed just in time (a baseline's, or
    an earlier stage's): a complete hint, so that CP-SAT starts from a solution."""
    m = model.model
    m.ClearHints()
    schedule = in_model_space(model.problem, schedule, model.rec)
    if schedule is None:
        return  # not a schedule of this model's space
    recomputed = set(schedule.recomputed)
    jit = make_schedule(model.problem, recomputed)
    at = dict(jit.recompute_at)
    values: dict[int, int] = {}
    variables: dict[int, object] = {}

    def put(x, value: int) -> None:
        if not isinstance(x, int):
            values[x.Index()] = int(value)
            variables[x.Index()] = x

    for v, x in model.rec.items():
        put(x, v in recomputed)
    for v, x in model.save.items():
        put(x, v in jit.saved)
    for v, literals in model.le.items():
        for p, x in literals.items():
            put(x, v in at and at[v] <= p)
    fused_into = _fused_into(model, jit)
    fusion = model.fusion
    for v, targets in fusion.targets.items():
        for t, x in targets.items():
            put(x, fused_into.get(v) == t)
    for (w, t), x in fusion.unfused_at.items():
        put(x, w in at and w not in fused_into and model.slot_of[(at[w], w)] == t)
    moved: dict[int, list[int]] = {}  # storage -> the slots its reads were moved to
    for u, reads in fusion.reads.items():
        moved[u] = [t for t, x in reads if values[x.Index()]]
    nf = model.problem.num_forward
    for g, literals in model.jit_le.items():
        own = None
        if g in recomputed:
            needs = [r if r >= nf else at[r] for r in model.readers[g] if r >= nf or r in at]
            own = min(needs)
        for p, x in literals.items():
            put(x, own is not None and own <= p)
    for v, chain in model.hge.items():
        held = v in recomputed or v in jit.saved
        last = [model.slot_of[(at[w], w)] for w in model.readers[v] if w in at]
        end = max(last + [model.direct_end[v]] + moved.get(v, []))
        for t, x in chain:
            put(x, held and end >= t)

    def evaluate_expr(terms) -> int:
        return sum(c * (x if isinstance(x, int) else values[x.Index()]) for c, x in terms)

    level = 0
    peak = 0
    for t in range(model.slots):
        x = model.decided[t]
        if not isinstance(x, int) and x.Index() not in values:
            level += evaluate_expr(model.events[t])
            put(x, level)
        peak = max(peak, level + model.fixed[t] + evaluate_expr(model.temp_at.get(t, [])))
    put(model.peak, peak)
    for index, value in values.items():
        m.AddHint(variables[index], value)


def _fused_into(model, schedule: Schedule) -> dict[int, int]:
    """The slot of `model` each copy the simulator fuses under `schedule` (just in time) is
    fused into: the one step its reads land on, read off the simulator's copies."""
    order = step_order(model.problem, schedule)
    at = schedule.recompute_at
    found = {}
    for v, copies in copies_of(model.problem, schedule, order).items():
        for copy in copies:
            if copy.fused:
                i, kind = order[copy.reads[-1]]
                found[v] = (model.slot_of[(at[i], i)] if kind is StepKind.RECOMPUTE
                            else model.op_slot[i])
    return found
