"""Sizes that depend on the data (``nonzero``, ``torch.where(mask)``, ``.item()``), each bounded
by its worst case.

A mixture of experts that gathers each expert's tokens with ``torch.where(mask)`` (DBRX) has
tensors whose first dimension is the number of tokens routed to that expert: a different size
at every step. Dynamo traces such ops into the one graph when asked
(`data_dependent_sizes`), their sizes then being *unbacked* symbols ``u0, u1...``: symbols
with no example value, only the range that torch proves for them (``nonzero`` over a tensor of
N elements: ``0..N``; ``torch._check(n <= c)`` in the model narrows it). The plan must hold at
every step, so the bytes remat gives such a tensor are its largest over that range, never what
one example happened to route: `bound_data_dependent` makes every such value concrete at its
worst case, so that the profile, the lowering and the rewrite's checks see ordinary sizes.

API
---
``data_dependent_sizes()``: the dynamo settings under which capture and the planned step
    trace ops whose output sizes (or scalars) depend on the data; restored after.
``bound_data_dependent(joint, label)``: each tensor value with an unbacked size made concrete
    at the largest size the symbols' ranges allow (the symbolic value stays in
    ``meta["unbacked_val"]``); the graph's ``meta["remat_worst_case"]`` lists them as
    `WorstCase`. A symbol without a finite upper bound raises CaptureError naming the op that
    makes it and the ``torch._check`` that would bound it. Sizes of symbolic nodes (SymInt
    values) stay symbolic: the rewrite saves them for the backward as AOTAutograd does.
``symbolic_again(gm)``: a graph made from such a joint graph (the rewrite's forward and
    backward) with its symbolic values back, for the compilers that read them (Inductor).
``worst_case_lines(cases)``: the report's lines on them.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch import fx

from remat.errors import CaptureError

__all__ = ["WorstCase", "bound_data_dependent", "data_dependent_sizes", "symbolic_again",
           "worst_case_lines"]


@dataclass(frozen=True)
class WorstCase:
    """A tensor whose size depends on the data, counted at its largest."""

    node: str  # the graph node (the problem's op of the same name)
    shape: str  # its symbolic shape, "[u3, 16]"
    ranges: str  # the symbols' ranges, "u3 <= 32"
    bound_bytes: int  # the bytes remat counts: the shape at the ranges' upper ends

    def __str__(self) -> str:
        return f"{self.node} {self.shape}: at most {self.bound_bytes:,} B ({self.ranges})"


@contextlib.contextmanager
def data_dependent_sizes() -> Iterator[None]:
    """Trace ``nonzero``/``where(mask)``/boolean indexing and ``.item()`` into the graph (unbacked
    symbols) instead of breaking it; dynamo's settings are restored on exit."""
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True,
                                    capture_scalar_outputs=True):
        yield


def _unbacked(value: Any) -> set:
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    try:
        return set(free_unbacked_symbols(value))
    except Exception:  # values free_unbacked_symbols does not walk (opaque objects)
        return set()


def _maker(joint: fx.GraphModule, symbol) -> str:
    """The node whose op produces `symbol` (its ``unbacked_bindings``), for the error."""
    for node in joint.graph.nodes:
        if symbol in (node.meta.get("unbacked_bindings") or {}):
            return f"{node.name} ({node.target})"
    for node in joint.graph.nodes:
        if symbol in _unbacked(node.meta.get("val")):
            return f"{node.name} ({node.target})"
    return "an op of the graph"


def _upper(expr, shape_env, joint: fx.GraphModule, label: str) -> int:
    """The largest value of a size expression over its symbols' ranges."""
    from torch.utils._sympy.value_ranges import bound_sympy

    if isinstance(expr, int):
        return expr
    expr = shape_env.replace(expr.node.expr) if isinstance(expr, torch.SymInt) else expr
    if getattr(expr, "is_number", False):
        return int(expr)
    upper = _finite(bound_sympy(expr, shape_env.var_to_range).upper)
    if upper is None:
        unbounded = [s for s in sorted(expr.free_symbols, key=str)
                     if s not in shape_env.var_to_range
                     or _finite(shape_env.var_to_range[s].upper) is None]
        symbol = unbounded[0] if unbounded else sorted(expr.free_symbols, key=str)[0]
        raise CaptureError(
            f"{label}: the size {expr} depends on the data and has no finite bound: {symbol} "
            f"comes from {_maker(joint, symbol)}, whose result torch cannot bound; remat plans "
            f"such sizes at their worst case, so bound it in the model, e.g. "
            f"`torch._check(n <= max_tokens)` right after the op that makes it")
    return max(upper, 0)


def _finite(value) -> int | None:
    """`value` (a sympy bound) as an int, or None when it is infinite (or absurdly large)."""
    try:
        number = int(value)
    except (TypeError, ValueError, AttributeError, OverflowError):
        return None
    return number if number < 2 ** 62 else None


def bound_data_dependent(joint: fx.GraphModule, label: str = "the model") -> list[WorstCase]:
    """Make every tensor value of `joint` with a data-dependent size concrete at its worst
    case (see the module's docstring); returns them, also kept in
    ``joint.meta["remat_worst_case"]``. Idempotent; a graph without such sizes is untouched."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    if "remat_worst_case" in joint.meta:
        return joint.meta["remat_worst_case"]
    found = [(n, _unbacked(n.meta.get("val"))) for n in joint.graph.nodes]
    found = [(n, symbols) for n, symbols in found if symbols]
    cases: list[WorstCase] = []
    if not found:
        joint.meta["remat_worst_case"] = cases
        return cases
    shape_env = _shape_env_of(found[0][0].meta["val"])
    mode = FakeTensorMode(allow_non_fake_inputs=True)

    def concrete(value):
        if not isinstance(value, torch.Tensor) or not _unbacked(value):
            return value
        sizes = [_upper(s, shape_env, joint, label) for s in value.shape]
        strides = [_upper(s, shape_env, joint, label) for s in value.stride()]
        with mode:
            return torch.empty_strided(sizes, strides, dtype=value.dtype, device=value.device,
                                       requires_grad=value.requires_grad)

    for node, symbols in found:
        value = node.meta["val"]
        if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            continue  # a size itself: the graphs pass it on symbolically
        node.meta["unbacked_val"] = value
        node.meta["val"] = torch.fx.node.map_aggregate(value, concrete)
        tensors = [v for v in (value if isinstance(value, (tuple, list)) else (value,))
                   if isinstance(v, torch.Tensor) and _unbacked(v)]
        for v, c in zip(tensors, [concrete(v) for v in tensors]):
            ranges = ", ".join(f"{s} <= {_upper(s, shape_env, joint, label)}"
                               for s in sorted(_unbacked(v), key=str))
            cases.append(WorstCase(node.name, f"[{', '.join(str(s) for s in v.shape)}]",
                                   ranges, c.untyped_storage().nbytes()))
    joint.meta["remat_worst_case"] = cases
    return cases


def symbolic_again(gm: fx.GraphModule) -> None:
    """Put back the symbolic values `bound_data_dependent` replaced (copied nodes share the
    meta's keys): the planning is done, and a compiler must see sizes that change."""
    for node in gm.graph.nodes:
        if "unbacked_val" in node.meta:
            node.meta["val"] = node.meta["unbacked_val"]


def _shape_env_of(value: Any):
    for v in (value if isinstance(value, (tuple, list)) else (value,)):
        sizes = (v,) if isinstance(v, torch.SymInt) else \
            (*v.shape, *v.stride()) if isinstance(v, torch.Tensor) else ()
        for s in sizes:
            if isinstance(s, torch.SymInt):
                return s.node.shape_env
    raise CaptureError("a data-dependent size without a shape environment")


def worst_case_lines(cases: list[WorstCase], *, owners: set[str] | None = None,
                     limit: int = 8) -> list[str]:
    """The report's lines: how many tensors are counted at their worst case, their bytes, the
    largest few. `owners`: the names that own a storage (views of them add no bytes)."""
    if not cases:
        return []
    owned = [c for c in cases if owners is None or c.node in owners]
    total = sum(c.bound_bytes for c in owned)
    lines = [f"data-dependent sizes: {len(cases)} tensors (nonzero/where/item results and what "
             f"follows them) counted at their worst case, {len(owned)} owning storage, "
             f"{total:,} B in all at the bound"]
    for c in sorted(owned, key=lambda c: -c.bound_bytes)[:limit]:
        lines.append(f"  {c}")
    if len(owned) > limit:
        lines.append(f"  ... {len(owned) - limit} more")
    return lines
