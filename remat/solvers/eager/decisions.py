"""Reading, hinting and checking the decisions of the eager CP-SAT model (`EagerModel`, which
builds on `EagerDecisions`): a policy's values for every boolean of the model, at their least
(the eager timeline's own holds), the bytes those values hold slot by slot, and the structure
the model assumes of `EagerBlocks`."""
from __future__ import annotations

from functools import cached_property

from remat.solvers.timeline.eager_blocks import EagerBlocks
from remat.solvers.core.problem import Kind, Problem

TRUE = True  # a literal that always holds (an op that always runs, a term with no condition)


class EagerDecisions:
    """What `EagerModel` offers once built: the attributes it reads are the model's (`cache`,
    `blocks`, `holds`, `ends`, `_none_defs`, `_some_uncached`, `events`, `fixed`, `temp_at`,
    `active`, `decided`, `slots`, `peak`, `_bools`, `model`, `runs_lit`, `problem`, `units`)."""

    def decision(self, value) -> frozenset[int]:
        """The cached ops of a solution (`value`: the solver's Value)."""
        return frozenset(v for unit, x in self.cache.items() if value(x) for v in unit)

    def assignment(self, cached) -> dict[int, int]:
        """Every boolean of the model for the policy caching `cached`, at its least value: the
        timeline's own holds (a complete hint)."""
        values = self._decided(cached)
        for x, none, runs in self._refs.none_defs:
            values[x] = int(_value(values, none) and not _value(values, runs))
        for presence, terms, ends in self._refs.holds:
            reached = next((k for k, refs in terms if all(_value(values, r) for r in refs)), -1)
            held = _value(values, presence)
            for k, x in ends:
                values[x] = int(held and reached >= k)
        return values

    @cached_property
    def _refs(self) -> "_Refs":
        """The literals that `assignment` and `levels` read, as indices, read once (Bamba: their
        Index calls were 0.5 s a round of the slot bound under load)."""
        return _Refs(self)

    def _decided(self, cached) -> dict[int, int]:
        """The cache units' booleans for the policy caching `cached`, and whether each
        multi-output call runs: all that the cost reads."""
        cached = set(cached) & self.blocks.cacheable  # as block_runs reads a policy
        values: dict[int, int] = {}
        for unit, x in self.cache.items():
            values[x.Index()] = int(bool(cached.intersection(unit)))
        for runs, lits in self._some_uncached:  # a multi-output call runs unless all cached
            values[runs.Index()] = int(not all(values[x.Index()] for x in lits))
        return values

    def levels(self, values: dict[int, int]) -> list[int]:
        """The bytes (units) live at each slot under `values` (assignment's)."""
        temps = self._refs.temps
        return [level + self.fixed[t] + sum(c * _value(values, r) for c, r in temps[t])
                for t, level in enumerate(self._running(values))]

    def _running(self, values: dict[int, int]) -> list[int]:
        """The running sum of the model's events (bytes held from each slot on) under
        `values`, slot by slot."""
        level, out = 0, []
        for events in self._refs.events:
            level += sum(c * _value(values, r) for c, r in events)
            out.append(level)
        return out

    def peak_of(self, cached) -> int:
        """The peak (units) of the policy caching `cached`, over the slots that run."""
        values = self.assignment(cached)
        live = self.levels(values)
        return max((b for b, x in zip(live, self.active)
                    if x is TRUE or literal_value(values, x)), default=0)

    def units_cost(self, cached) -> int:
        """The model's objective (cost units) for the policy caching `cached`."""
        values = self._decided(cached)
        ops, units = self.problem.ops, self.units
        return sum(units.cost_of(ops[v].cost) * literal_value(values, x)
                   for v, x in self.runs_lit.items() if x is not TRUE)

    def hint(self, cached) -> None:
        m = self.model
        m.ClearHints()
        values = self.assignment(cached)
        for index, value in values.items():
            m.AddHint(self._bools[index], value)
        live = self.levels(values)
        hinted = set()
        for x, level in zip(self.decided, self._running(values)):
            if not isinstance(x, int) and x.Index() not in hinted:  # one variable per change
                hinted.add(x.Index())
                m.AddHint(x, level)
        m.AddHint(self.peak, max(live, default=0))


def literal_value(values: dict[int, int], x) -> int:
    return _value(values, _ref(x))


def negated(x):
    return x.Not() if x is not TRUE else False


def check_structure(problem: Problem, blocks: EagerBlocks) -> None:
    """What the model assumes of the structure, which `remat.fx_passes.eager.policy` builds:
    a policy caches a multi-output op's tensors, never the tuple op or a view; groups are the
    tensors of distinct ops; eager holds a forward tensor at least to its own op."""
    seen: set[int] = set()
    for group in blocks.groups:
        if seen.intersection(group):
            raise ValueError(f"EagerBlocks.groups overlap at {sorted(seen & set(group))}")
        seen.update(group)
    for v in blocks.cacheable | seen:
        if problem.ops[v].kind is Kind.TUPLE:
            raise ValueError(f"{problem.ops[v].name!r} is a tuple op: a policy caches the "
                             "tensors taken out of it, never the tuple op")
    for v, last in blocks.forward_life.items():
        if last < v:
            raise ValueError(f"EagerBlocks.forward_life holds {problem.ops[v].name!r} to an "
                             "op before it")


def _ref(x) -> int | None:
    return None if x is TRUE else x.Index()


def _value(values: dict[int, int], ref: int | None) -> int:
    """`literal_value` of the literal whose index is `ref` (None: TRUE)."""
    if ref is None:
        return 1
    return values[ref] if ref >= 0 else 1 - values[-ref - 1]


class _Refs:
    """A model's literals as indices (`_ref`): the "none" definitions, each hold's presence,
    terms (latest slot first: the first that holds is how far it is held) and ends, and the
    events and temps per slot."""

    def __init__(self, model: EagerDecisions):
        self.none_defs = [(x.Index(), _ref(none), _ref(runs))
                          for x, none, runs in model._none_defs]
        self.holds = [(_ref(h.presence),
                       [(k, tuple(_ref(x) for x in lits))
                        for k, lits in sorted(h.terms, key=lambda term: -term[0])],
                       [(k, x.Index()) for k, x in ends])
                      for h, ends in zip(model.holds, model.ends)]
        self.events = [[(c, _ref(x)) for c, x in model.events.get(t, ())]
                       for t in range(model.slots)]
        self.temps = [[(c, _ref(x)) for c, x in model.temp_at.get(t, ())]
                      for t in range(model.slots)]
