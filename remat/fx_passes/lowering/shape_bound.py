"""The memory of a range of shapes, bounded by the problem of its largest one.

A plan for a range of shapes is solved once, on the problem lowered at the range's largest
shape, and run at every shape of the range with the same decisions (the same ops, saved or
recomputed alike: the graph is one symbolic graph, `remat.fx_passes.tracing.dynamic`). The
timeline of a schedule is a maximum of sums of op sizes, over moments that the graph and the
schedule fix, whatever the sizes. So if no op holds more at any shape of the range than the
problem says, no moment does, and the problem's peak (the solver's, checked against the budget)
bounds every step of the range.

`bound_range(problem, captured)` establishes that, op by op, from the bytes of each node of
the symbolic graph as an expression in the range's names (``128*batch*seq``, the storage
pass's ``bytes_expr``): an expression that is a polynomial with non-negative coefficients
grows with every name, so its largest value is at the largest shape, where the problem was
measured (and the pass checks that the two agree). Any other expression (a difference, a floor
division) is evaluated over every point of the range and the op is given its worst value: the
plan is then made for the worst case, and `RangeProof.worst_case` says where. A size that
depends on the data (a symbol no input dimension is the source of: tokens per expert) cannot
be bounded and is refused.

What is taken as it was measured at the largest shape, not derived: kernel scratch (`Op.temp`
beyond the outputs), which grows with the kernel's inputs; the allocator checks it
(benchmarks/shape_range.py measures every step of a run).

The problem that comes back carries the expressions in ``source["byte_expressions"]``, so that
the compiled step can check the graph it is handed against them without fixing its sizes.
"""
from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, replace
from typing import Any

from remat.errors import RematError
from remat.fx_passes.measuring.storage import remat_meta
from remat.solvers.core.problem import Kind, Problem

log = logging.getLogger(__name__)

__all__ = ["RangeProof", "bound_range"]

MOST_POINTS = 2_000_000  # points of a range evaluated for an expression that may not grow


@dataclass(frozen=True)
class RangeProof:
    """How a bucket's problem bounds its range: `ops` ops with a symbolic size, `monotone` of
    them growing with every name; `worst_case` the others as (op, bytes at the largest shape,
    bytes planned: their largest over the range)."""

    bucket: str
    largest: tuple[tuple[str, int], ...]
    ops: int
    monotone: int
    worst_case: tuple[tuple[str, int, int], ...] = ()

    @property
    def proven(self) -> bool:
        """Every op's bytes are largest at the largest shape: the plan's peak there is the
        peak of the range (no worst case had to be planned)."""
        return not self.worst_case

    def to_dict(self) -> dict:
        return {"bucket": self.bucket, "largest": dict(self.largest), "ops": self.ops,
                "monotone": self.monotone, "worst_case": [list(w) for w in self.worst_case]}


def bound_range(problem: Problem, captured: Any) -> tuple[Problem, RangeProof]:
    """`problem` (lowered from `captured`, a capture for a range) with every op's bytes at
    least their largest over the bucket's range, and how that was shown."""
    import sympy

    bucket = captured.bucket
    parts = {p.name: p for p in bucket.parts}
    symbols = {name: sympy.Symbol(name, positive=True, integer=True) for name in parts}
    largest = {symbols[n]: p.hi for n, p in parts.items()}
    by_name = {n.name: n for n in captured.graph.nodes}
    ops = list(problem.ops)
    expressions: dict[str, list[str]] = {}
    counted = monotone = 0
    worst: list[tuple[str, int, int]] = []
    for i, op in enumerate(ops):
        node = by_name.get(op.name)
        meta = remat_meta(node) if node is not None else {}
        if "bytes_expr" not in meta:
            continue  # made after the trace (generator snapshots): constant sizes
        texts = [meta["bytes_expr"], meta["tuple_bytes_expr"]]
        expressions[op.name] = texts
        text = texts[1] if op.kind is Kind.TUPLE else texts[0]
        expr = _parse(text, symbols, op.name)
        if not expr.free_symbols:
            continue
        counted += 1
        at_largest = int(expr.xreplace(largest))
        planned = op.temp if op.kind is Kind.TUPLE else op.size
        if (op.kind is Kind.TUPLE and at_largest > planned) or \
                (op.kind is not Kind.TUPLE and op.size and at_largest != planned):
            raise RematError(f"op {op.name!r}: its bytes over the range ({text}) give "
                             f"{at_largest} at the largest shape, where it was measured at "
                             f"{planned}; the range cannot be bounded")
        if _grows(expr):
            monotone += 1
            continue
        top = _largest_over(expr, parts, symbols, op.name)
        if top > at_largest:
            worst.append((op.name, at_largest, top))
            ops[i] = (replace(op, temp=op.temp + top - at_largest) if op.kind is Kind.TUPLE
                      else replace(op, size=top))
    if worst:
        log.warning("%d ops of %s hold more bytes at a smaller shape than at the largest (%s): "
                    "planned at their worst over the range", len(worst), bucket,
                    ", ".join(w[0] for w in worst[:3]))
    source = {**problem.source, "byte_expressions": expressions,
              "shape_range": str(bucket)}
    proof = RangeProof(bucket=str(bucket), largest=tuple(bucket.largest.items()), ops=counted,
                       monotone=monotone, worst_case=tuple(worst))
    return Problem(tuple(ops), name=problem.name, source=source), proof


def _parse(text: str, symbols: dict, op: str):
    import sympy

    local = {**symbols, **_SIZE_FUNCTIONS()}
    try:
        expr = sympy.sympify(text, locals=local)
    except (sympy.SympifyError, TypeError) as e:
        raise RematError(f"op {op!r}: its bytes over the range ({text}) cannot be read: {e}")
    unknown = expr.free_symbols - set(symbols.values())
    if unknown:
        raise RematError(
            f"op {op!r} holds {text} bytes, where {sorted(map(str, unknown))} depend on the "
            "data, not on a named input dimension (tokens routed to an expert, a nonzero "
            "count): no range of input shapes bounds it; plan fixed shapes at the worst case")
    return sympy.expand(expr)


def _SIZE_FUNCTIONS() -> dict:
    """torch's integer functions of sizes (torch.utils._sympy.functions), in sympy's terms."""
    import sympy

    def floor_div(a, b):
        return sympy.floor(a / b)

    return {"FloorDiv": floor_div, "CleanDiv": floor_div, "IntTrueDiv": lambda a, b: a / b,
            "CeilDiv": lambda a, b: sympy.ceiling(a / b), "Mod": sympy.Mod,
            "PythonMod": sympy.Mod, "ModularIndexing": lambda a, b, c: sympy.Mod(
                sympy.floor(a / b), c), "Max": sympy.Max, "Min": sympy.Min}


def _grows(expr) -> bool:
    """A polynomial with non-negative coefficients in positive sizes: it never shrinks when a
    size grows."""
    import sympy

    try:
        poly = sympy.Poly(expr, *sorted(expr.free_symbols, key=str))
    except sympy.PolynomialError:
        return False
    return all(c >= 0 for c in poly.coeffs())


def _largest_over(expr, parts: dict, symbols: dict, op: str) -> int:
    """The largest value of `expr` over every point of the range (the names it reads)."""
    import numpy as np
    import sympy

    names = sorted(n for n in parts if symbols[n] in expr.free_symbols)
    points = 1
    for n in names:
        points *= parts[n].hi - parts[n].lo + 1
    if points > MOST_POINTS:
        raise RematError(
            f"op {op!r} holds {expr} bytes, which does not grow with {', '.join(names)}; "
            f"bounding it means evaluating {points:,} shapes: narrow the range")
    grids = np.meshgrid(*[np.arange(parts[n].lo, parts[n].hi + 1, dtype=np.int64)
                          for n in names], indexing="ij")
    fn = sympy.lambdify([symbols[n] for n in names], expr, modules="numpy")
    values = np.broadcast_to(np.asarray(fn(*grids)), grids[0].shape)
    return int(np.ceil(values.max()))


def corners(parts: dict) -> list[dict[str, int]]:
    """Every corner of a range (for tests that evaluate an expression there)."""
    return [dict(zip(parts, c)) for c in itertools.product(*[(p.lo, p.hi)
                                                              for p in parts.values()])]
