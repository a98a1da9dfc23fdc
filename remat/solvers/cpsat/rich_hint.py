"""Hinting the rich model (`rich_model.RichModel`) from a schedule: every variable, reads
assigned by `simulate`'s latest-copy rule and ends tight, so that CP-SAT starts from it as a
solution (the single model's plan in "auto", a baseline's in "rich")."""
from __future__ import annotations

from remat.solvers.cpsat.units import in_model_space
from remat.solvers.core.problem import tuple_of
from remat.solvers.core.schedule import Schedule
from remat.solvers.timeline.simulate import StepKind, copies_of, holds, step_order


def hint(model, schedule: Schedule) -> bool:
    """Hint every variable from `schedule` (reads assigned by `simulate`'s rule, ends
    tight); False, hinting nothing, when the schedule is outside the model's space."""
    m, problem = model.model, model.problem
    m.ClearHints()
    schedule = in_model_space(problem, schedule, model.further)
    if schedule is None:
        return False
    positions = copy_positions(schedule)
    chosen = _chosen_copies(model, schedule, positions)
    if chosen is None:
        return False
    _hint_runs(model, chosen)
    first_after = _hint_first_after(model, chosen)
    for u, c in model.load.items():
        m.AddHint(c.active, u in schedule.offload_at)
        m.AddHint(c.pos, schedule.offload_at.get(u, problem.num_forward))
    order = step_order(problem, schedule)
    slot, key = _steps(model, schedule, order, positions)
    found = copies_of(problem, schedule, order)
    for u, copies in model.storages.items():
        assigned = _hint_copies(model, schedule, order, u, found[u], chosen, first_after, slot,
                                key)
        for k, c in enumerate(copies):
            if c.active is not None and k not in assigned.values():
                m.AddHint(c.end, model.horizon - 1)
                m.AddHint(c.length, 1)
        for (s, i, k), x in model.x.items():
            if s == u:
                m.AddHint(x, assigned.get(i) == k)
    m.AddHint(model.peak, max(model.fixed_peak, _peak_of(model, schedule, order)))
    return True


def _chosen_copies(model, schedule: Schedule, positions) -> dict[int, dict[int, int]] | None:
    """The position of each model copy the schedule runs, by value and copy index; None
    where the schedule has more runs, or loads, than the model has copies for."""
    chosen: dict[int, dict[int, int]] = {}
    for v, copies in model.further.items():
        ps = positions.get(v, [])
        t = tuple_of(model.problem, v)
        slots = positions.get(t, []) if copies[0].shared else ps
        if len(slots) > len(copies) or not set(ps) <= set(slots):
            return None
        chosen[v] = {k: p for k, p in enumerate(slots) if p in ps}
    if not (positions.keys() <= model.further.keys()
            and schedule.offload_at.keys() <= model.load.keys()):
        return None
    return chosen


def _hint_runs(model, chosen: dict[int, dict[int, int]]) -> None:
    """Each further run: whether it runs, where, and whether in the backward."""
    m, nf = model.model, model.problem.num_forward
    for v, copies in model.further.items():
        for k, c in enumerate(copies):
            on = k in chosen[v]
            m.AddHint(c.active, on)
            if not c.shared:
                m.AddHint(c.pos, chosen[v].get(k, c.low))
            if c.free:
                m.AddHint(c.backward, on and chosen[v][k] >= nf)
        if v in model.moved:  # the most of its copies' `backward` literals
            m.AddHint(model.moved[v], any(c.free and k in chosen[v] and chosen[v][k] >= nf
                                          for k, c in enumerate(copies)))


def _hint_first_after(model, chosen: dict[int, dict[int, int]]) -> dict[int, int]:
    """The first step after each tuple op t that `RichModel._first_after` models, as hinted
    (and the runs placed there)."""
    m = model.model
    first_after: dict[int, int] = {}
    for t, first in model._first.items():
        here = [(x, chosen[v].get(k) == t + 1, v) for x, v, k in model._here[t]]
        for x, on, _ in here:
            m.AddHint(x, on)
        first_after[t] = min([model.op_time(t + 1)]
                             + [model.rec_time(t + 1, v) for _, on, v in here if on])
        m.AddHint(first, first_after[t])
    return first_after


def _steps(model, schedule: Schedule, order, positions) -> tuple[list[int], list]:
    """Each step of `order`: its model slot, and its read key (`RichModel.reads`; None for a
    load)."""
    slot, key = [], []
    runs: dict[int, int] = {}
    for i, kind in order:
        if kind is StepKind.RECOMPUTE:
            j = runs[i] = runs.get(i, -1) + 1
            slot.append(model.rec_time(positions[i][j], i))
            key.append((i, j))
        elif kind is StepKind.RELOAD:
            slot.append(schedule.offload_at[i] * model.width)
            key.append(None)
        else:
            slot.append(model.op_time(i))
            key.append((i, None))
    return slot, key


def _hint_copies(model, schedule: Schedule, order, u: int, found, chosen, first_after,
                 slot: list[int], key: list) -> dict[int, int]:
    """The end and length of each copy of storage u that the schedule makes (`found`, as
    simulate has them), ends tight; returns the model copy each read is assigned to."""
    m, problem = model.model, model.problem
    copies = model.storages[u]
    index = {k: i for i, k in enumerate(model.reads[u])}
    recomputes = iter(sorted(chosen.get(u, {})))
    assigned: dict[int, int] = {}
    t_of = tuple_of(problem, u)
    for c in found:
        if c.kind is StepKind.FORWARD:
            k, made = 0, copies[0].made
        elif c.kind is StepKind.RELOAD:
            k, made = len(copies) - 1, schedule.offload_at[u] * model.width
        else:
            j = next(recomputes)
            k, p = j + 1, chosen[u][j]
            made = model.rec_time(p, u) if t_of is None else model.rec_time(p, t_of) + 1
        for t in c.reads:
            assigned[index[key[t]]] = k
        end = max([slot[t] for t in c.reads] + [made])
        bare = t_of is not None and (u in model.further or not problem.storage_readers[u])
        if c.kind is StepKind.FORWARD and bare:
            # A bare getitem's forward copy lives to the step after its tuple op's
            # (the model's rule, `RichModel._first_after`); hinted shorter, the hint failed.
            end = max(end, first_after[t_of])
        if c.until >= 0 and u in model.load:  # held while its copy to host runs
            rel = next((i for i, kind in order[c.until + 1:]
                        if kind in (StepKind.FORWARD, StepKind.BACKWARD)),
                       problem.num_forward)
            if model.transfers is not None:
                m.AddHint(model.transfers.release[u], rel)
            end = max(end, rel * model.width - 1)
        m.AddHint(copies[k].end, end)
        m.AddHint(copies[k].length, end + 1 - made)
    return assigned


def _peak_of(model, schedule: Schedule, order) -> int:
    """The schedule's simulated peak in the model's units (sizes rounded up)."""
    up = model.units.bytes_up
    delta = [0] * (len(order) + 1)
    for _, size, first, last in holds(model.problem, schedule, order):
        delta[first] += up(size)
        delta[last + 1] -= up(size)
    level, peak = 0, 0
    for t, (i, _) in enumerate(order):
        level += delta[t]
        peak = max(peak, level + up(model.problem.ops[i].temp))
    return peak


def copy_positions(schedule: Schedule) -> dict[int, list[int]]:
    """Each value's further copies' positions, in order: `again` and `recompute_at` together."""
    positions: dict[int, list[int]] = {}
    for v, b in schedule.recompute_at.items():
        positions.setdefault(v, []).append(b)
    for v, ps in schedule.again.items():
        positions.setdefault(v, []).extend(ps)
    return {v: sorted(ps) for v, ps in positions.items()}
