"""Input sizes that change from step to step: which dimensions of which inputs carry a named size
("batch", "seq"), the range each name takes, and the graphs the range needs.

One symbolic graph serves every size of a range: dynamo traces the step with the named
dimensions as symbols (``torch._dynamo.mark_dynamic`` with the range as bounds), so the ops do
not depend on the sizes, and a graph whose code specializes a size inside the range is refused
when traced. Dynamo always specializes a size of 1 (broadcasting and contiguity depend on it,
and eager PyTorch dispatches other ops there too: a ``contiguous()`` that copies at batch 8 is
a no-op at batch 1), so a range that holds 1 needs a second graph for it. A `Bucket` is one
such graph's share of the range: per name, either one pinned size or a symbolic interval.

API
---
``ShapeRange(ranges, dims)``: the names' ranges and the input dimensions that carry them;
    `buckets()`, `bucket_of(sizes)`, `sizes_of(args, kwargs)`.
``resized(args, kwargs, shape_range, sizes)``: the inputs tiled or cut to other sizes (the
    largest shape of a bucket is planned from the user's example).
``mark(args, kwargs, shape_range, bucket)``: mark the bucket's symbolic dimensions for dynamo.
``tracing_sizes()``: the context under which a marked step is traced (no duck sizing: two
    names of equal size at the first call must not become one symbol).
``symbol_names(joint, shape_range)`` and ``in_names(value, names)``: a symbolic graph's sizes
    as expressions in the names ("12288*batch*seq"); ``specialized(joint, shape_range, bucket)``:
    the names the trace narrowed; ``concretize(joint)``: the same graph at its example's sizes,
    for the passes that measure (profile, lower).
"""
from __future__ import annotations

import contextlib
import itertools
import math
import operator
import re
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch import fx

from remat.errors import CaptureError

__all__ = ["Bucket", "DimRange", "InputDim", "ShapeRange", "concretize", "in_names",
           "is_size_arithmetic", "mark", "marked",
           "resized", "specialized", "symbol_names", "tracing_sizes"]

BATCH, SEQ = "batch", "seq"


@dataclass(frozen=True)
class DimRange:
    """The sizes ``lo..hi`` (both included) that the dimensions named `name` take."""

    name: str
    lo: int
    hi: int

    @property
    def pinned(self) -> bool:
        return self.lo == self.hi

    def __str__(self) -> str:
        return f"{self.name} {self.lo}" if self.pinned else f"{self.name} {self.lo}..{self.hi}"


@dataclass(frozen=True)
class InputDim:
    """Dimension `dim` of input `input` (a keyword's name, or a position) has size `name`."""

    input: str | int
    dim: int
    name: str

    def __str__(self) -> str:
        where = self.input if isinstance(self.input, str) else f"positional input {self.input}"
        return f"{where} dim {self.dim}"


@dataclass(frozen=True, order=True)
class Bucket:
    """One compiled graph's share of a range: per name, a pinned size or an interval; for
    an eager plan whose ops depend on padding (`ShapeRange.padding`), also whether the
    batch has padding."""

    parts: tuple[DimRange, ...]
    padded: bool | None = None

    @property
    def largest(self) -> dict[str, int]:
        return {p.name: p.hi for p in self.parts}

    @property
    def symbolic(self) -> dict[str, DimRange]:
        return {p.name: p for p in self.parts if not p.pinned}

    def __str__(self) -> str:
        shapes = ", ".join(str(p) for p in self.parts)
        return shapes if self.padded is None else \
            f"{shapes}, {'with' if self.padded else 'without'} padding"


@dataclass(frozen=True)
class ShapeRange:
    """Named sizes with their ranges, and the input dimensions that carry each name.
    `padding`: the input whose zeros mark padding (an attention mask), where the step's ops
    depend on whether a batch has any: eager Hugging Face attention skips its mask for a
    batch without padding. None: they do not (a traced graph has one path)."""

    ranges: tuple[DimRange, ...]
    dims: tuple[InputDim, ...]
    padding: str | int | None = None

    def range_of(self, name: str) -> DimRange:
        return next(r for r in self.ranges if r.name == name)

    @property
    def largest(self) -> dict[str, int]:
        return {r.name: r.hi for r in self.ranges}

    def buckets(self) -> list[Bucket]:
        """The graphs the range needs: a size of 1 is a graph of its own (dynamo specializes
        it), the sizes from 2 up share one."""
        choices = []
        for r in self.ranges:
            parts = []
            if r.lo == 1 and r.hi > 1:
                parts.append(DimRange(r.name, 1, 1))
            low = 2 if r.lo == 1 and r.hi > 1 else r.lo
            parts.append(DimRange(r.name, low, r.hi))
            choices.append(parts)
        # The largest first: the bucket of the range's largest shape is the plan's own.
        return sorted((Bucket(tuple(c)) for c in itertools.product(*choices)),
                      key=lambda b: -math.prod(p.hi for p in b.parts))

    def bucket_of(self, sizes: dict[str, int], padded: bool | None = None) -> Bucket:
        for bucket in self.buckets():
            if all(p.lo <= sizes[p.name] <= p.hi for p in bucket.parts):
                return Bucket(bucket.parts, padded if self.padding is not None else None)
        raise KeyError(sizes)  # sizes are checked against the range before (call_checks)

    def padded(self, args: tuple, kwargs: dict) -> bool | None:
        """Whether the call's batch has padding (a zero in the `padding` input)."""
        mask = _input(args, kwargs, self.padding) if self.padding is not None else None
        return None if not isinstance(mask, torch.Tensor) else bool((mask == 0).any())

    def dims_of(self, key: str | int) -> list[InputDim]:
        return [d for d in self.dims if d.input == key]

    def sizes_of(self, args: tuple, kwargs: dict) -> dict[str, int]:
        """Each name's size in a call (the first input dimension that carries it)."""
        sizes: dict[str, int] = {}
        for d in self.dims:
            value = _input(args, kwargs, d.input)
            if isinstance(value, torch.Tensor) and value.dim() > d.dim:
                sizes.setdefault(d.name, int(value.shape[d.dim]))
        return sizes

    def __str__(self) -> str:
        return ", ".join(str(r) for r in self.ranges)


def _input(args: tuple, kwargs: dict, key: str | int) -> Any:
    if isinstance(key, int):
        return args[key] if key < len(args) else None
    return kwargs.get(key)


def resized(args: tuple, kwargs: dict, shape_range: ShapeRange,
            sizes: dict[str, int]) -> tuple[tuple, dict]:
    """Copies of the inputs with each named dimension tiled (repeated) or cut to `sizes`: a
    batch of another shape made from an example, with the example's own values. An input
    passed twice (labels=input_ids) stays one tensor: dynamo traces another graph for two."""
    memo: dict[int, Any] = {}

    def one(key, value):
        if not isinstance(value, torch.Tensor):
            return value
        if id(value) not in memo:
            copy = value
            for d in shape_range.dims_of(key):
                want, have = sizes[d.name], copy.shape[d.dim]
                if want != have:
                    copies = -(-want // have)
                    copy = torch.cat([copy] * copies, dim=d.dim).narrow(d.dim, 0, want)
            memo[id(value)] = copy.detach().clone().requires_grad_(value.requires_grad)
        return memo[id(value)]

    return (tuple(one(i, v) for i, v in enumerate(args)),
            {k: one(k, v) for k, v in kwargs.items()})


def mark(args: tuple, kwargs: dict, shape_range: ShapeRange, bucket: Bucket) -> None:
    """Mark the bucket's symbolic dimensions of the call's inputs for dynamo, with their
    bounds: dynamo then refuses (ConstraintViolationError) a graph that is not valid over the
    whole interval, instead of silently specializing it. The tensors themselves are marked,
    as ``torch._dynamo.mark_dynamic`` users do: a view in their place would change the graph
    where one tensor is passed twice (labels=input_ids)."""
    symbolic = bucket.symbolic
    for d in shape_range.dims:
        part = symbolic.get(d.name)
        value = _input(args, kwargs, d.input)
        if part is not None and isinstance(value, torch.Tensor):
            torch._dynamo.mark_dynamic(value, d.dim, min=part.lo, max=part.hi)


def marked(compiled: Any, shape_range: ShapeRange, bucket: Bucket) -> Any:
    """A compiled step that marks each call's inputs for `bucket` and traces them as
    `tracing_sizes` says: one graph for every call in the bucket."""

    def step(*args, **kwargs):
        mark(args, kwargs, shape_range, bucket)
        with tracing_sizes():
            return compiled(*args, **kwargs)

    return step


@contextlib.contextmanager
def tracing_sizes() -> Iterator[None]:
    """Trace marked dimensions as independent symbols: dynamo's duck sizing would make two
    dimensions of equal size at the first call one symbol (batch 8 and seq 8), and the graph
    would only serve calls where they are equal."""
    import torch.fx.experimental._config as fx_config

    with fx_config.patch(use_duck_shape=False):
        yield


# ----------------------------------------------------------------------- the symbolic graph


def is_size_arithmetic(node: fx.Node) -> bool:
    """A node of a symbolic graph that computes a size (``sym_size``, a product of sizes):
    no tensor, no kernel; eager PyTorch reads sizes without dispatching an op."""
    target = node.target
    if getattr(target, "__module__", None) in ("_operator", "operator") \
            and target is not operator.getitem:
        return True
    return str(target).startswith(("aten.sym_size", "aten.sym_stride", "aten.sym_numel",
                                   "aten.sym_storage_offset"))



def _shape_env(joint: fx.GraphModule):
    for node in joint.graph.find_nodes(op="placeholder"):
        value = node.meta.get("val")
        sizes = (value,) if isinstance(value, torch.SymInt) else \
            tuple(value.shape) if isinstance(value, torch.Tensor) else ()
        for s in sizes:
            if isinstance(s, torch.SymInt):
                return s.node.shape_env
    return None


_SOURCE = re.compile(r"^L\['(args|kwargs)'\]\[('?)([^\]']+)\2\]\.size\(\)\[(\d+)\]$")


def _source_name(source: Any) -> str:
    name = source.name
    return name() if callable(name) else name


def symbol_names(joint: fx.GraphModule, shape_range: ShapeRange) -> dict[str, str]:
    """Each symbol of a symbolic graph whose source is a named input dimension -> the name
    (the step is traced as ``step(*args, **kwargs)``: sources are ``L['args'][0]`` and
    ``L['kwargs']['input_ids']``)."""
    shape_env = _shape_env(joint)
    if shape_env is None:
        return {}
    named = {(d.input, d.dim): d.name for d in shape_range.dims}
    names: dict[str, str] = {}
    for symbol, sources in shape_env.var_to_sources.items():
        for source in sources:
            found = _SOURCE.match(_source_name(source))
            if found is None:
                continue
            kind, _, key, dim = found.groups()
            key = int(key) if kind == "args" else key
            if (key, int(dim)) in named:
                names[str(symbol)] = named[(key, int(dim))]
    return names


def in_names(value: Any, names: dict[str, str]) -> str:
    """`value` (an int or SymInt) as an expression in the range's names (`names`: a symbol's
    name -> the size it stands for, `symbol_names`). Symbols that no named input dimension is
    the source of (sizes that depend on the data) keep their own names."""
    import sympy

    if not isinstance(value, torch.SymInt):
        return str(int(value))
    expr = value.node.shape_env.replace(value.node.expr)
    mapping = {s: sympy.Symbol(names.get(str(s), str(s)), positive=True, integer=True)
               for s in expr.free_symbols}
    return str(expr.xreplace(mapping))


def specialized(joint: fx.GraphModule, shape_range: ShapeRange, bucket: Bucket) -> list[str]:
    """The bucket's symbolic names that the trace narrowed: replaced by a constant, or bounded
    tighter than the bucket's interval (code that branches on a size). Dynamo would refuse
    such a graph when it compiles; a capture, which stops before, asks here."""
    shape_env = _shape_env(joint)
    if shape_env is None:
        return [f"{p.name} (traced as a constant)" for p in bucket.symbolic.values()]
    found = []
    symbols = {str(s): s for s in shape_env.var_to_sources}
    for key, name in symbol_names(joint, shape_range).items():
        part, symbol = bucket.symbolic.get(name), symbols[key]
        if part is None:
            continue
        replaced = shape_env.replace(symbol)
        if getattr(replaced, "is_number", False):
            found.append(f"{name} (specialized to {replaced})")
            continue
        names = symbol_names(joint, shape_range)
        tied = sorted({names.get(str(s), str(s)) for s in replaced.free_symbols} - {name})
        if tied:
            found.append(f"{name} (tied to {', '.join(tied)})")
            continue
        bounds = shape_env.var_to_range.get(symbol)
        if bounds is not None and (int(bounds.lower) > part.lo or
                                   (bounds.upper.is_finite and int(bounds.upper) < part.hi)):
            found.append(f"{name} (only {bounds.lower}..{bounds.upper} traced as one graph)")
    return sorted(set(found))


def concretize(joint: fx.GraphModule, shape_range: ShapeRange, bucket: Bucket,
               label: str) -> None:
    """Make a symbolic joint graph, traced for `bucket`, concrete at the example's sizes (the
    symbols' hints: the bucket's largest shape), which the profile and the lowering measure;
    same nodes, same names. Each node's symbolic value stays in ``meta["symbolic_val"]`` and
    the graph's ``meta["remat_symbol_names"]`` maps its symbols to the range's names."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    narrowed = specialized(joint, shape_range, bucket)
    if narrowed:
        raise CaptureError(
            f"{label}'s training step cannot be one graph for {bucket}: its code specializes "
            f"{', '.join(narrowed)} (a branch on a size, or a size used as a constant); plan "
            "a range within which the code takes one path, or plan the sizes apart")
    joint.meta["remat_symbol_names"] = symbol_names(joint, shape_range)
    for node in joint.graph.nodes:
        if "val" in node.meta:
            node.meta["symbolic_val"] = node.meta["val"]
    mode = FakeTensorMode(allow_non_fake_inputs=True)

    def hint(s):
        if not isinstance(s, torch.SymInt):
            return int(s)
        value = s.node.hint
        if value is None:
            raise CaptureError(f"a size of {label}'s graph depends on the data ({s}); such a "
                               "step cannot be planned for a range of shapes")
        return int(value)

    def concrete(value):
        if isinstance(value, torch.SymInt):
            return hint(value)
        if isinstance(value, torch.Tensor):
            with mode:
                return torch.empty_strided([hint(s) for s in value.shape],
                                           [hint(s) for s in value.stride()],
                                           dtype=value.dtype, device=value.device,
                                           requires_grad=value.requires_grad)
        return value

    inputs = [concrete(n.meta.get("val")) for n in joint.graph.find_nodes(op="placeholder")]
    with mode:
        FakeTensorProp(joint, mode).propagate_dont_convert_inputs(*inputs)
