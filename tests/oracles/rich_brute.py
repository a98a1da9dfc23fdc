"""Exhaustive search over the richer execution model: the oracle of the rich CP-SAT model.

The space (`Schedule.again`, `Schedule.offload_at`): every set of backward
recomputations at every valid backward position (`brute_force.placements`), plus, per forward
value, up to `max_copies` further copies, each at any forward position after the value or any
backward position after its first backward recomputation, plus, where the problem has a host
link, the offload of any saved tensor with its load back at any backward op up to its first
backward read, as long as the host holds what is offloaded (`Problem.host_capacity`). Every
schedule is judged by `simulate` (memory) and `remat.solvers.timeline.overlap` (what the step waits
for its transfers, part of the cost); nothing here shares the CP-SAT model's logic.

Which positions are enumerated, and why all of them. No placement dominates another:
- a forward copy of v placed before a reader serves the same reads at any position between the
  previous read and that reader, but an earlier position holds v longer while a later one holds
  v's inputs longer (the copy reads them): which is better depends on their sizes, exactly as
  for backward recomputations (brute_force's docstring); and the copy's `temp` lands on its step;
- a load from host placed earlier holds the value longer but hides more of its transfer under
  the compute before its first reader.
So every position is enumerated. What is left out, with the proof that nothing is lost:
- copies that serve no read: `make_schedule` rejects them (a copy nobody reads is no schedule);
- further copies of values that own no bytes: such a copy changes no storage's bytes, only reads
  the value's inputs once more and adds its temp, so dropping it never raises any step's live
  bytes and never adds cost. Views are rebuilt from their base and never copied themselves.

The search is over "shapes" (per value: how many forward copies, whether the backward
recomputes it, how many further backward copies, whether it is offloaded), best first by a lower
bound of their cost (a tuple op's cost is shared among its getitems, so two getitems copied at
one position, which run it once, are not overcounted), and then over every placement of a
shape. It prunes soundly:
- cost: once a schedule fits, no node whose cost bound exceeds its cost can hold a better one,
  and best-first order leaves none unvisited below it;
- memory: `ShapeBounds` gives, for a shape, bytes that every placement of it holds at each op's
  step. A node (a shape, some values frozen, the rest at option 0: saved, no copy) whose bound
  exceeds the budget at a step is split on the free values holding bytes there: the first
  changed, or the first kept and the second changed, ...; a shape that keeps all of them holds
  the same bytes at that step, so nothing that fits is lost, and each shape lies below one
  child only. Other nodes are placed, then split on every free value.
"""
from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass
from types import MappingProxyType

from remat.errors import BudgetError
from remat.solvers.baselines.brute_force import placements
from remat.solvers.core.problem import Kind, Problem, needed_storages, recompute_blocker, tuple_of
from tests.oracles.rich_brute_bounds import ShapeBounds
from remat.solvers.core.schedule import Schedule, Status, recomputable
from remat.solvers.timeline.evaluate import make_schedule
from remat.solvers.timeline.overlap import transfers
from remat.solvers.timeline.simulate import simulate, step_order

MAX_SCHEDULES = 1_000_000  # placed schedules simulated
MAX_SHAPES = 3_000_000  # shapes visited


@dataclass(frozen=True)
class _Choice:
    """One value's part of a shape."""

    cost: float  # a lower bound of what this part costs
    forward: int = 0  # further copies within the forward
    recompute: bool = False  # recomputed in the backward
    backward: int = 0  # further copies in the backward, after the first recomputation
    offload: bool = False


def rich_brute_force(problem: Problem, budget: int, *, max_copies: int = 2,
                     offload: bool | None = None) -> Schedule:
    """The least-cost, then least-peak, schedule over the richer space that fits `budget`
    (status OPTIMAL). `offload` None: offload iff the problem has a host link. Raises
    BudgetError (smallest None) when nothing fits, ValueError beyond MAX_SHAPES shapes or
    MAX_SCHEDULES schedules."""
    best = _Search(problem, max_copies, offload).run(budget)
    if best is None:  # the least peak is a search of its own (rich_smallest_peak), often longer
        raise BudgetError(f"rich_brute_force: no schedule of the richer model fits a budget of "
                          f"{budget:,} bytes; rich_smallest_peak gives the least peak any "
                          "reaches", budget=budget, smallest=None)
    return best


def rich_smallest_peak(problem: Problem, *, max_copies: int = 2,
                       offload: bool | None = None) -> int:
    """The least activation peak of any schedule in the richer space, by enumeration."""
    return _Search(problem, max_copies, offload).smallest()


class _Search:
    def __init__(self, problem: Problem, max_copies: int, offload: bool | None):
        if not isinstance(max_copies, int) or max_copies < 0:
            raise ValueError(f"max_copies must be a non-negative int, not {max_copies!r}")
        if offload is None:
            offload = problem.host_bandwidth is not None
        if offload and not problem.host_bandwidth:
            raise ValueError("offload=True needs a problem with host_bandwidth to cost the "
                             "transfers")
        self.problem, self.max_copies, self.offload = problem, max_copies, offload
        ops, nf = problem.ops, problem.num_forward
        self.nf = nf
        backward_ok = set(recomputable(problem))
        candidates = set(problem.candidates)
        self.values, self.options = [], []
        for v in range(nf):
            op = ops[v]
            if op.kind is not Kind.TENSOR or not op.size or v in problem.pinned:
                continue
            copyable = recompute_blocker(problem, v) is None and max_copies > 0
            offloadable = offload and v in candidates
            if not (copyable or v in backward_ok or offloadable):
                continue
            self.values.append(v)
            self.options.append(self._options(v, copyable, v in backward_ok, offloadable))
        self.index = {v: i for i, v in enumerate(self.values)}
        self.bounds = ShapeBounds(problem)
        # The ops whose recomputation reads v's storage (not the forward's end, which
        # storage_readers adds for forward outputs).
        self.recompute_readers = [[u for u in problem.storage_readers[v]
                                   if v in problem.storage_inputs[u]] for v in range(nf)]
        self.simulated = 0

    def _options(self, v: int, copyable: bool, backward_ok: bool, offloadable: bool):
        problem, k = self.problem, self.max_copies
        t = tuple_of(problem, v)
        share = problem.ops[v].cost
        if t is not None:  # a lower bound: the getitems copied together run the tuple op once
            share += problem.ops[t].cost / len(problem.users[t])
        # An offload may cost nothing: its transfers can run entirely under the compute.
        options = [_Choice(0.0)]
        if offloadable:
            options.append(_Choice(0.0, offload=True))
        for f in range(k + 1 if copyable else 1):
            if f:
                options.append(_Choice(f * share, forward=f))
                if offloadable:
                    options.append(_Choice(f * share, forward=f, offload=True))
            if backward_ok:
                for a in range(k - f + 1):
                    options.append(_Choice((1 + f + a) * share, forward=f, recompute=True,
                                           backward=a))
        return sorted(options, key=lambda c: c.cost)

    # -- the search over shapes ------------------------------------------------------------

    def _nodes(self, threshold):
        """Best-first branch and bound over shapes. A node is a shape and the values it has
        frozen; its other values are at option 0 (saved, no copy), the cheapest, so the node's
        cost bound holds for every shape below it. A node whose position-free peak bound
        exceeds `threshold(cost)` at some op's step is split on the values free to change that
        step's holding: the first changed (to any other option), or the first kept and the
        second changed, and so on; every shape below the node that could fit is below exactly
        one child, since a shape keeping them all holds the same bytes there. Other nodes are
        yielded (cost, vec, decoded), then split on every free value alike.
        Yields nodes in nondecreasing cost bound."""
        n = len(self.values)
        heap = [(0.0, 0, (0,) * n, frozenset())]
        serial = itertools.count(1)
        visited = 0
        while heap:
            cost, _, vec, frozen = heapq.heappop(heap)
            visited += 1
            if visited > MAX_SHAPES:
                raise ValueError(f"rich_brute_force stops at {MAX_SHAPES:,} shapes; this problem "
                                 "has more: use a smaller problem or max_copies")
            free = [i for i in range(n) if i not in frozen]
            decoded = self._decode(vec)
            split = free
            if decoded is not None:
                limit = threshold(cost)
                if limit is None:
                    return
                holders = self._conflict(decoded, limit, set(free))
                if holders is None:
                    yield cost, vec, decoded
                else:
                    split = holders
            elif threshold(cost) is None:
                return
            for k, i in enumerate(split):
                keep = frozen | set(split[:k]) | {i}
                for j in range(1, len(self.options[i])):
                    child = vec[:i] + (j,) + vec[i + 1:]
                    heapq.heappush(heap, (cost + self.options[i][j].cost, next(serial), child,
                                          keep))

    def _conflict(self, decoded, limit, free: set[int]):
        """None if the shape's peak bound is within `limit`; else the free values (as indices
        into self.values) holding bytes at the op's step over it that has the fewest."""
        best = None
        for live, holders in self._shape_steps(decoded):
            if live > limit:
                mine = [self.index[v] for v in holders if self.index.get(v) in free]
                if best is None or len(mine) < len(best):
                    best = mine
                    if not best:
                        break
        return best

    def _shape_steps(self, decoded):
        """`ShapeBounds.steps` of a decoded shape."""
        _, saved, chosen = decoded
        copied = frozenset(v for v, c in chosen.items() if c.forward)
        on_device = frozenset(v for v in saved if not (v in chosen and chosen[v].offload))
        # One copy serves every backward read: a recomputation with no further backward copy,
        # or a load from host.
        spanning = frozenset(v for v, c in chosen.items()
                             if (c.recompute and not c.backward) or c.offload)
        return self.bounds.steps(copied, on_device, spanning)

    def _decode(self, vec):
        """(recomputed with tuple ops, saved, choices by value), or None for a shape that is no
        schedule (recomputes what the backward never needs, saves a tuple op, offloads what
        is not saved)."""
        problem = self.problem
        chosen = {v: self.options[i][j] for i, (v, j) in enumerate(zip(self.values, vec)) if j}
        recomputed = {v for v, c in chosen.items() if c.recompute}
        recomputed |= {t for t in map(lambda v: tuple_of(problem, v), recomputed)
                       if t is not None}
        needed = needed_storages(problem, recomputed)
        if not recomputed <= needed:
            return None
        saved = needed - recomputed
        if any(problem.ops[v].kind is Kind.TUPLE for v in saved):
            return None
        if any(c.offload and v not in saved for v, c in chosen.items()):
            return None
        if problem.host_capacity is not None and sum(
                problem.ops[v].size for v, c in chosen.items() if c.offload) \
                > problem.host_capacity:
            return None  # the host cannot hold what the shape offloads
        return frozenset(recomputed), frozenset(saved), chosen

    # -- the searches --------------------------------------------------------------------------

    def run(self, budget: int) -> Schedule | None:
        best_key, best = None, None

        def threshold(cost):
            if best_key is None:
                return budget
            tolerance = best_key[0] * 1e-9 + 1e-15
            if cost > best_key[0] + tolerance:
                return None
            if cost < best_key[0] - tolerance:  # a cheaper schedule may lie below
                return budget
            return min(budget, best_key[1] - 1)

        for cost_bound, vec, decoded in self._nodes(threshold):
            for sched, runs in self._placed(decoded, lambda: threshold(cost_bound)):
                if best_key is not None and runs > best_key[0] * (1 + 1e-9) + 1e-15:
                    continue  # the transfers only add to it
                cost = runs
                if sched.offload_at:  # what the step waits for them (remat.solvers.timeline.overlap)
                    cost = runs + transfers(self.problem, sched,
                                            step_order(self.problem, sched)).exposed
                peak = simulate(self.problem, sched).peak
                if peak > budget or (best_key is not None and (cost, peak) >= best_key):
                    continue
                best_key, best = (cost, peak), sched
        if best is None:
            return None
        return make_schedule(self.problem, best.recomputed, recompute_at=best.recompute_at,
                             again=best.again, offload_at=best.offload_at,
                             strategy="rich_brute_force", status=Status.OPTIMAL, budget=budget,
                             bound=best_key[0], info={"schedules": self.simulated})

    def smallest(self) -> int:
        smallest = simulate(self.problem, make_schedule(self.problem, [])).peak
        for _, vec, decoded in self._nodes(lambda cost: smallest - 1):
            for sched, _ in self._placed(decoded, lambda: smallest - 1):
                smallest = min(smallest, simulate(self.problem, sched).peak)
        return smallest

    # -- placements of one shape ---------------------------------------------------------------

    def _placed(self, decoded, limit):
        """Every valid placement of the shape: (unevaluated Schedule, its recomputations' cost:
        the transfers' part is the caller's to add), but those
        whose recomputations alone, placed, hold more than `limit()` (read anew for each, as
        the best schedule improves; None: stop) at an op's step."""
        recomputed, saved, chosen = decoded
        problem = self.problem
        ops = problem.ops
        moving = sorted((v for v, c in chosen.items()
                         if c.forward or c.backward or c.offload), reverse=True)
        steps = self._shape_steps(decoded)
        single = [v for v in recomputed if v in chosen and not chosen[v].backward]
        for positions in placements(problem, recomputed):
            bytes_limit = limit()
            if bytes_limit is None:
                return
            if single and self._placed_over(positions, single, steps, bytes_limit):
                continue
            fwd: dict[int, tuple[int, ...]] = {}
            bwd: dict[int, tuple[int, ...]] = {}
            reload: dict[int, int] = {}
            for _ in self._assign(moving, 0, chosen, positions, fwd, bwd, reload):
                again = {v: fwd.get(v, ()) + bwd.get(v, ()) for v in fwd.keys() | bwd.keys()}
                for v in list(again):  # a getitem's copies run its tuple op there
                    t = tuple_of(problem, v)
                    if t is not None:
                        again[t] = tuple(sorted(set(again.get(t, ())) | set(again[v])))
                runs = [ops[v].cost for v in recomputed]
                runs += [ops[v].cost for v, ps in again.items() for _ in ps]
                self.simulated += 1
                if self.simulated > MAX_SCHEDULES:
                    raise ValueError(f"rich_brute_force stops at {MAX_SCHEDULES:,} schedules; "
                                     "this problem has more: use a smaller problem or "
                                     "max_copies")
                yield (Schedule(saved=saved, recomputed=recomputed,
                                recompute_at=MappingProxyType(positions),
                                again=MappingProxyType(again),
                                offload_at=MappingProxyType(dict(reload))),
                       math.fsum(sorted(runs)))

    def _placed_over(self, positions, single, steps, limit) -> bool:
        """Whether the shape's bound plus the recomputations in `single` (each the one
        backward copy of its value, so live from its position to its last backward read, a
        recomputed reader's included) exceeds `limit` at some op's step."""
        ops, fixed = self.problem.ops, self.bounds.fixed
        extra: dict[int, int] = {}
        for v in single:
            end = self.bounds.last_backward_op_read[v]
            for u in self.recompute_readers[v]:
                if u in positions:
                    end = max(end, positions[u] - 1)
            for b in range(positions[v], end + 1):
                if v not in fixed[b] and v not in steps[b][1]:
                    extra[b] = extra.get(b, 0) + ops[v].size
        return any(steps[b][0] + add > limit for b, add in extra.items())

    def _assign(self, moving, k, chosen, positions, fwd, bwd, reload):
        """Positions of the further copies and loads of moving[k:], largest value first, so
        that every reader's copies are placed before the value's own (whose copies must each
        serve a read)."""
        if k == len(moving):
            yield
            return
        v, c = moving[k], chosen[moving[k]]
        nf, n = self.nf, len(self.problem.ops)
        reads = self._reads(v, positions, fwd, bwd)
        for fs in itertools.combinations(range(v + 1, nf), c.forward):
            start = positions.get(v)
            backs = (itertools.combinations(range(start + 1, n), c.backward)
                     if c.recompute else [()])
            for bs in backs:
                loads = range(nf, min(r for r in reads if r >= nf) + 1) if c.offload else [None]
                for b in loads:
                    made = [*fs, *([start] if c.recompute else []), *bs,
                            *([b] if b is not None else [])]
                    if (fs or bs) and not _every_copy_read(made, reads):
                        continue
                    _put(fwd, v, fs), _put(bwd, v, bs)
                    if b is not None:
                        reload[v] = b
                    yield from self._assign(moving, k + 1, chosen, positions, fwd, bwd, reload)
                    fwd.pop(v, None), bwd.pop(v, None), reload.pop(v, None)

    def _reads(self, v, positions, fwd, bwd) -> list[int]:
        """Where v's storage is read, as op positions (a recomputation placed before op p reads
        at p, after any copy of v placed there: copies at one position run in forward order)."""
        problem = self.problem
        reads = list(problem.storage_readers[v])
        for u in self.recompute_readers[v]:
            for w in self._runs_of(u):
                reads.extend(fwd.get(w, ()))
                reads.extend(bwd.get(w, ()))
            if u in positions:
                reads.append(positions[u])
        return sorted(reads)

    def _runs_of(self, u: int):
        """The values whose copies run op u: u itself, or, for a tuple op, its getitems."""
        if self.problem.ops[u].kind is Kind.TUPLE:
            return self.problem.users[u]
        return (u,)


def _put(table: dict, v: int, positions: tuple) -> None:
    if positions:
        table[v] = positions


def _every_copy_read(made: list[int], reads: list[int]) -> bool:
    """Whether every copy after the first (made before the positions `made`, sorted) serves a
    read: each read goes to the latest copy made at or before its position."""
    made = sorted(made)
    bounds = made[1:] + [math.inf]
    return all(any(lo <= r < hi for r in reads) for lo, hi in zip(made, bounds))
