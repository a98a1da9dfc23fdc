"""Hinting the just-in-time model (`jit_model.JitModel`) from a schedule: every variable, the
schedule re-placed just in time, so that CP-SAT starts from it as a solution."""
from __future__ import annotations

from remat.solvers.cpsat.units import in_model_space
from remat.solvers.core.schedule import Schedule
from remat.solvers.timeline.evaluate import make_schedule


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
    for v, copy in model.fused.items():
        put(copy.literal, v in recomputed and not recomputed.intersection(copy.recomputed_readers))
        for both, parent, u in copy.chained:
            put(both, values[parent.Index()] and u in recomputed)
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
        end = max(last + [model.direct_end[v]])
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
