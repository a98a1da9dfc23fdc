"""The simulated peak of many schedules of one problem, each in O(n) with small constants.

Baselines that search over decisions (greedy's and selective's prefixes, the tiled strategy's
per-block allowance) evaluate dozens of schedules. `make_schedule` followed by `simulate`
validates the decision and builds a Step object per step: about 0.1-0.3 s per schedule at 20,000
ops. `PeakMeter` precomputes what does not depend on the decision once, then gives the peak
that `simulate` gives (the tests check it against `simulate` on random problems) without
validating or building a timeline. Strategies still return `make_schedule`'s schedule for the
decision they pick, so the simulator remains the judge of what they hand back.
"""
from __future__ import annotations

import math
from itertools import accumulate
from operator import add
from typing import Iterable, Mapping

from remat.solvers.core.problem import Problem, tuple_of
from remat.solvers.core.schedule import latest_positions


class PeakMeter:
    """Peaks, costs and needed sets of decisions on one problem (forward op indices that the
    backward recomputes)."""

    def __init__(self, problem: Problem):
        self.problem = problem
        ops = problem.ops
        n, nf = len(ops), problem.num_forward
        self._nf = nf
        self._cost = [op.cost for op in ops]
        self._temp = [op.temp for op in ops]
        self._tuple = [tuple_of(problem, i) for i in range(n)]
        self._inputs = problem.storage_inputs
        readers = problem.storage_readers
        pinned = problem.pinned
        # Forward storages read by the backward itself: needed whatever is recomputed.
        self._read_by_backward = frozenset(s for b in problem.backward
                                           for s in self._inputs[b] if s < nf)
        # What every schedule holds alike, as live bytes at each forward op (`_forward`), at each
        # backward op (`_at`) and at recomputations placed before each backward op
        # (`_before`): every storage until its last forward reader, outputs to the end, and
        # backward values. A forward storage that the backward needs varies: it is saved up to
        # its last reader, or held again from its recomputation; for those `_varying` lists
        # (op, bytes, tuple op, last forward reader or itself, last backward reader or -1).
        forward, at, before = [0] * (nf + 1), [0] * (n + 1), [0] * (n + 1)
        self._varying = []
        self._unread = []
        candidates = set(problem.candidates)
        for i, op in enumerate(ops):
            if problem.root[i] != i or op.size == 0:
                continue
            tup = self._tuple[i]
            # A tensor taken out of a tuple op is live from the step after the tuple op's.
            first = i if tup is None else tup + 1
            if i >= nf:
                if not readers[i] and tup is not None and i not in pinned:
                    # Held at one step, the one after its tuple op's, which may be a
                    # recomputation: it depends on the schedule.
                    self._unread.append((tup, op.size))
                    continue
                stop = n - 1 if i in pinned else max(readers[i], default=i)
                at[first] += op.size
                at[stop + 1] -= op.size
                before[first if tup is not None else i + 1] += op.size
                before[stop + 1] -= op.size
                continue
            last_forward = max([r for r in readers[i] if r < nf], default=first)
            forward[first] += op.size
            if i in pinned:
                forward[nf] -= op.size
                at[nf] += op.size
                before[nf] += op.size
                continue
            forward[last_forward + 1] -= op.size
            if i in candidates:
                self._varying.append((i, op.size, tup, last_forward,
                                      max([r for r in readers[i] if r >= nf], default=-1)))
        temp = self._temp
        self._forward_fixed = [live + temp[t] for t, live in enumerate(accumulate(forward[:nf]))]
        self._backward_fixed = [live + temp[b]
                                for b, live in enumerate(accumulate(at[:n])) if b >= nf]
        self._before = list(accumulate(before[:n]))

    def needed(self, recomputed: Iterable[int]) -> set[int]:
        """`needed_storages(problem, recomputed)`: forward storages the backward reads, directly
        or through a recomputation."""
        recomputed = set(recomputed)
        nf = self._nf
        needed = set(self._read_by_backward)
        frontier = [v for v in needed if v in recomputed]
        while frontier:
            for s in self._inputs[frontier.pop()]:
                if s < nf and s not in needed:
                    needed.add(s)
                    if s in recomputed:
                        frontier.append(s)
        return needed

    def drop_unneeded(self, recomputed: Iterable[int]) -> set[int]:
        """`schedule.drop_unneeded`: the decision with its tuple ops, without what the backward
        would not need under it."""
        recomputed = set(recomputed)
        recomputed.update(t for t in [self._tuple[v] for v in recomputed] if t is not None)
        return recomputed & self.needed(recomputed)

    def cost(self, recomputed: Iterable[int]) -> float:
        """Recompute cost, summed exactly (the same float whatever the order of the set)."""
        return math.fsum(self._cost[v] for v in recomputed)

    def peak(self, recomputed: set[int], positions: Mapping[int, int] | None = None) -> int:
        """`simulate(problem, schedule).peak` for the schedule that recomputes `recomputed`
        (tuple ops included, nothing unneeded: `drop_unneeded`'s result) at `positions`
        (just in time when None), saving the rest of what the backward needs."""
        problem, nf = self.problem, self._nf
        n = len(problem.ops)
        if positions is None:
            positions = latest_positions(problem, recomputed, problem.storage_readers)
        saved = self.needed(recomputed) - recomputed

        # Steps: forward op i is step i; before backward op b run the recomputations placed
        # there, in forward order, so b's step is b plus the recomputations at or before it
        # (`shift[b - nf]`).
        placed: dict[int, list[int]] = {}
        for v in sorted(recomputed):
            placed.setdefault(positions[v], []).append(v)
        count = [0] * (n - nf)
        for b, values in placed.items():
            count[b - nf] = len(values)
        shift = list(accumulate(count))
        again: dict[int, int] = {}
        for b, values in placed.items():
            first = b + shift[b - nf] - len(values)
            for rank, v in enumerate(values):
                again[v] = first + rank
        total = n + len(recomputed)

        # The last step at which a recomputation reads each storage.
        read_again: dict[int, int] = {}
        for v, t in again.items():
            for s in self._inputs[v]:
                if read_again.get(s, -1) < t:
                    read_again[s] = t

        delta = [0] * (total + 1)
        for i, size, tup, last_forward, last_backward in self._varying:
            if i in saved:
                start = last_forward + 1
            elif i in again:
                start = again[i] if tup is None else again[tup] + 1
            else:
                continue
            end = last_backward + shift[last_backward - nf] if last_backward >= 0 else start - 1
            end_again = read_again.get(i, -1)
            if end_again > end:
                end = end_again
            if end >= start:
                delta[start] += size
                delta[end + 1] -= size
            elif i in again:  # recomputed and never read: held at its own step
                delta[start] += size
                delta[start + 1] -= size
        for tup, size in self._unread:
            made = tup + shift[tup - nf] + 1
            delta[made] += size
            delta[made + 1] -= size
        # What every schedule holds alike, and each step's temp bytes, in step order: the
        # backward ops' in runs between the positions of recomputations.
        temp, before, ops_fixed = self._temp, self._before, self._backward_fixed
        fixed = self._forward_fixed.copy()
        previous = nf
        for b in sorted(placed):
            fixed.extend(ops_fixed[previous - nf:b - nf])
            fixed.extend(before[b] + temp[v] for v in placed[b])
            previous = b
        fixed.extend(ops_fixed[previous - nf:])
        return max(map(add, accumulate(delta[:total]), fixed), default=0)
