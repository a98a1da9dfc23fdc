"""`optimize(..., dynamic={"batch": (1, 8), "seq": (8, 128)})`: one plan for every step of a
range of shapes.

The user names the sizes that vary and their ranges; by default "batch" is dimension 0 of
every tensor input and "seq" dimension 1 of every tensor input with two or more dimensions
(`dynamic_dims={"pixel_values": {0: "batch", 2: "height"}}` says otherwise, and names any
other size). The range is planned as a few buckets (`remat.fx_passes.tracing.dynamic`): the
sizes from 2 up share one graph whose sizes are symbols, and a size of 1, which PyTorch
specializes (another graph in compiled mode, other ops in eager mode), is a bucket of its own.
Each bucket is captured once at its largest shape and planned there, under the same budget;
the plan holds at every shape of the bucket because no op of its graph holds more bytes at a
smaller shape (`remat.fx_passes.lowering.shape_bound`, which plans the worst case where that
is not so). Every bucket is planned here, in `optimize`: nothing is planned again while
training, and a call outside the range is refused before it runs
(`remat.fx_passes.tracing.call_checks`).
"""
from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

from remat.errors import RematError
from remat.planner.job.budget import format_size

log = logging.getLogger(__name__)

__all__ = ["RangePlans", "parse_range", "plan_range"]

DEFAULT_DIMS = {"batch": 0, "seq": 1}
PADDING = "attention_mask"  # the input whose zeros are padding (Hugging Face's name)


def _padded(mask, padded: bool):
    """A mask like the example's, without padding (all ones) or with (its last position,
    the last sequence's end, masked)."""
    import torch

    mask = torch.ones_like(mask)
    if padded:
        mask.view(-1)[-1] = 0
    return mask


def parse_range(dynamic: dict, dynamic_dims: dict | None, args: tuple, kwargs: dict):
    """The `ShapeRange` the user's `dynamic` (name -> (lo, hi), or hi for 1..hi) and
    `dynamic_dims` (input -> {dim: name}) describe, checked against the example inputs."""
    import torch

    from remat.fx_passes.tracing.dynamic import DimRange, InputDim, ShapeRange

    if not isinstance(dynamic, dict) or not dynamic:
        raise ValueError("dynamic= takes a dict of named sizes and their ranges, e.g. "
                         "dynamic={\"batch\": (1, 8), \"seq\": (8, 128)}")
    ranges = []
    for name, value in dynamic.items():
        lo, hi = (1, value) if isinstance(value, int) else tuple(value)
        if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi):
            raise ValueError(f"dynamic[{name!r}] = {value!r}: give (smallest, largest) sizes, "
                             "1 <= smallest <= largest")
        ranges.append(DimRange(str(name), lo, hi))
    inputs = [*enumerate(args), *kwargs.items()]
    tensors = {key: v for key, v in inputs if isinstance(v, torch.Tensor)}
    dims: list[InputDim] = []
    if dynamic_dims is None:
        unknown = [r.name for r in ranges if r.name not in DEFAULT_DIMS]
        if unknown:
            raise ValueError(f"dynamic= names {unknown}: say which input dimensions carry them "
                             f"with dynamic_dims={{input: {{dim: name}}}} (only "
                             f"{sorted(DEFAULT_DIMS)} have a default: dims 0 and 1)")
        for key, value in tensors.items():
            for r in ranges:
                if value.dim() > DEFAULT_DIMS[r.name]:
                    dims.append(InputDim(key, DEFAULT_DIMS[r.name], r.name))
    else:
        names = {r.name for r in ranges}
        for key, table in dynamic_dims.items():
            if key not in tensors:
                raise ValueError(f"dynamic_dims names input {key!r}, which is not a tensor "
                                 f"input of the example (those are {sorted(map(str, tensors))})")
            for dim, name in table.items():
                if name not in names or not 0 <= dim < tensors[key].dim():
                    raise ValueError(f"dynamic_dims[{key!r}][{dim}] = {name!r}: the name must be "
                                     f"one of dynamic= ({sorted(names)}) and the dimension one "
                                     f"of the input's {tensors[key].dim()}")
                dims.append(InputDim(key, dim, name))
    shape_range = ShapeRange(tuple(ranges), tuple(dims))
    _check_example(shape_range, tensors)
    return shape_range


def _check_example(shape_range, tensors: dict) -> None:
    seen: dict[str, tuple[int, Any]] = {}
    for r in shape_range.ranges:
        if not shape_range.dims or not any(d.name == r.name for d in shape_range.dims):
            raise ValueError(f"dynamic[{r.name!r}]: no input dimension carries it (name one with "
                             "dynamic_dims=)")
    for d in shape_range.dims:
        size = int(tensors[d.input].shape[d.dim])
        first = seen.setdefault(d.name, (size, d))
        if first[0] != size:
            raise ValueError(f"the example's {d} is {size} but its {first[1]} is {first[0]}; "
                             f"both would be {d.name!r}: say which dimensions carry it with "
                             "dynamic_dims={input: {dim: name}}")


@dataclass
class RangePlans:
    """What a plan for a range of shapes is made of: the range, and for each bucket its plan
    (the largest bucket's is the plan `optimize` returned) and how its problem bounds it."""

    shape_range: Any  # remat.fx_passes.tracing.dynamic.ShapeRange
    plans: dict  # Bucket -> Plan, the largest bucket first
    planning_time: float

    @property
    def largest(self) -> dict[str, int]:
        return self.shape_range.largest

    def notes(self) -> list[str]:
        first = next(iter(self.plans.values()))
        largest = ", ".join(f"{k} {v}" for k, v in self.largest.items())
        lines = [f"planned for the range {self.shape_range} in {len(self.plans)} bucket(s), "
                 f"{self.planning_time:.1f} s: the peak at its largest shape ({largest}) is "
                 f"{format_size(first.peak)}, activations {format_size(first.activation_peak)}"]
        for bucket, plan in self.plans.items():
            proof = plan.prepared.range_proof
            how = ("every op's bytes grow with the sizes (checked on the symbolic graph), so "
                   "the largest shape bounds the bucket" if proof.proven else
                   f"{len(proof.worst_case)} ops hold more at smaller shapes and are planned at "
                   f"their worst ({', '.join(w[0] for w in proof.worst_case[:3])})")
            lines.append(f"bucket {bucket}: peak {format_size(plan.peak)} at its largest shape; "
                         f"{how}; kernel scratch as measured at its largest shape")
        return lines

    def to_dict(self) -> dict:
        return {"range": {r.name: [r.lo, r.hi] for r in self.shape_range.ranges},
                "dims": [[d.input, d.dim, d.name] for d in self.shape_range.dims],
                "planning_time": self.planning_time,
                "buckets": [{"bucket": str(b), "peak": p.peak,
                             "activation_peak": p.activation_peak,
                             "proof": p.prepared.range_proof.to_dict()}
                            for b, p in self.plans.items()]}


def plan_range(model: Any, dynamic: dict, dynamic_dims: dict | None, args: tuple,
               kwargs: dict, plan_one: Callable, execution: str = "compiled"):
    """Plan every bucket of the range `dynamic` names: ``plan_one(args, kwargs, shape_range)``
    at each bucket's largest shape (made from the example: tiled or cut along the named
    dimensions). Returns the largest bucket's plan, its `shapes` the `RangePlans`.

    Eager PyTorch runs other ops on other data where a model branches on it: Hugging Face's
    attention skips its mask for a batch without padding. An eager plan whose inputs hold an
    ``attention_mask`` is therefore made for each bucket twice, with padding and without (the
    example's mask all ones, or its last position masked), and each call runs the policies of
    its kind. A compiled plan traces one path for both."""
    from remat.fx_passes.tracing.dynamic import Bucket, resized
    from remat.planner.plans.prepare import has_meta_weights

    if has_meta_weights(model):
        raise RematError("dynamic=: a plan for a range of shapes is made and run on real "
                         "weights (each bucket's graph is traced where it runs); load or "
                         "initialize the weights, or plan fixed shapes on meta tensors")
    shape_range = parse_range(dynamic, dynamic_dims, args, kwargs)
    mask = kwargs.get(PADDING)
    if execution == "eager" and getattr(mask, "dim", lambda: 0)() >= 2:
        shape_range = dataclasses.replace(shape_range, padding=PADDING)
    start = time.perf_counter()
    plans = {}
    for shapes in shape_range.buckets():
        for padded in ((None,) if shape_range.padding is None else (True, False)):
            bucket = Bucket(shapes.parts, padded)
            log.info("planning bucket %s of the range %s", bucket, shape_range)
            b_args, b_kwargs = resized(args, kwargs, shape_range, bucket.largest)
            if padded is not None:
                b_kwargs[PADDING] = _padded(b_kwargs[PADDING], padded)
            plans[bucket] = plan_one(b_args, b_kwargs, shape_range)
    main = next(iter(plans.values()))
    main.shapes = RangePlans(shape_range, plans, time.perf_counter() - start)
    return main
