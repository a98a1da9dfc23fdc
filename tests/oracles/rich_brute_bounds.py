"""Position-free bounds for `rich_brute`: bytes that every placement of a shape holds.

A shape fixes, per forward value, how many further copies it has in the forward, whether the
backward recomputes it (and how many further backward copies), whether it is offloaded; not
where. What it holds regardless of where is a lower bound on the peak of each placement, which
lets the exhaustive search skip shapes (and split on their holders) without placing them.
"""
from __future__ import annotations

from remat.solvers.core.problem import Kind, Problem, tuple_of


class ShapeBounds:
    """What every placement of a shape must hold at each op's step, placements aside: each op's
    temp, output and the storages it reads; outputs; backward values between their op and last
    reader; and, by the shape, forward values with no copy in the forward between their op and
    last forward reader (to the end of the forward if the backward reads that copy), saved
    values kept on the device from the end of the forward to their last backward reader, and
    values whose one backward copy (a recomputation with no further one, or a load from host)
    serves every backward read, from the first backward reader to the last. These depend on the
    value's own choice, and on whether it is saved, which only recomputed readers change."""

    def __init__(self, problem: Problem):
        self.problem = problem
        ops, nf = problem.ops, problem.num_forward
        n = len(ops)
        self.fixed: list[set[int]] = [set() for _ in range(n)]
        for i, op in enumerate(ops):
            here = self.fixed[i]
            here.update(s for s in problem.storage_inputs[i] if ops[s].size)
            if op.kind is Kind.TENSOR and op.size and problem.root[i] == i \
                    and tuple_of(problem, i) is None:
                here.add(i)
        for s in problem.pinned:
            for i in range(s, n):
                if ops[s].size:
                    self.fixed[i].add(s)
        for w in range(nf, n):
            readers = problem.storage_readers[w]
            if problem.root[w] == w and ops[w].size and w not in problem.pinned and readers:
                for i in range(w, max(readers) + 1):
                    self.fixed[i].add(w)
        self.last_forward_read = [max((r for r in problem.storage_readers[v] if r < nf),
                                      default=v) for v in range(nf)]
        self.first_backward_op_read = [min((r for r in problem.storage_readers[v] if r >= nf),
                                           default=n) for v in range(nf)]
        self.last_backward_op_read = [max((r for r in problem.storage_readers[v] if r >= nf),
                                          default=-1) for v in range(nf)]
        self.free = [v for v in range(nf) if problem.root[v] == v and ops[v].size
                     and v not in problem.pinned]
        self.fixed_bytes = [sum(ops[s].size for s in fixed) for fixed in self.fixed]
        self.cache: dict = {}

    def steps(self, copied: frozenset[int], on_device: frozenset[int],
              spanning: frozenset[int]):
        """(bytes, the values held by the shape) at each op's step."""
        key = (copied, on_device, spanning)
        if key not in self.cache:
            self.cache[key] = self._steps(copied, on_device, spanning)
        return self.cache[key]

    def _steps(self, copied, on_device, spanning):
        ops, nf = self.problem.ops, self.problem.num_forward
        result = []
        for i, fixed in enumerate(self.fixed):
            live = ops[i].temp + self.fixed_bytes[i]
            holders = []
            for v in self.free:
                if v in fixed:
                    continue
                if i < nf:
                    if v >= i:
                        continue
                    if v in copied:
                        hold = v in on_device and i == nf - 1
                    else:
                        hold = v in on_device or self.last_forward_read[v] >= i
                elif v in spanning:
                    hold = self.first_backward_op_read[v] <= i <= self.last_backward_op_read[v]
                else:
                    hold = v in on_device and self.last_backward_op_read[v] >= i
                if hold:
                    live += ops[v].size
                    holders.append(v)
            result.append((live, tuple(holders)))
        return result
