"""What a planned training call must look like, checked before any work is done.

A plan is made for one training step: inputs of given names, dtypes and shapes (or shapes
within a planned range, `remat.fx_passes.tracing.dynamic`), under a given autocast state, with
given parameters requiring grad, in their dtypes. A call that differs in any of these runs
another graph: the compiled mode's graph would not match the plan (an error about some
``_to_copy`` or ``detach`` node deep in the graph), the eager mode's blocks would dispatch
other ops, and in both the memory the plan holds was never proven for it. `CallSpec` records
those causes when the plan is made and names the one that changed, with the remedy.

Grad mode and the model's train/eval mode are not training-call causes here: a call under
``torch.no_grad()`` or in the other mode is not the planned training step at all (the planned
module's own mode check deals with it).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from remat.errors import RematError
from remat.fx_passes.tracing.dynamic import DimRange, ShapeRange

__all__ = ["CallSpec", "InputSpec", "autocast_state", "describe_autocast", "uncached_autocast"]

_AUTOCAST_DEVICES = ("cpu", "cuda", "xpu", "hpu", "mps")
_PLAIN = (int, float, bool, str, type(None))


def autocast_state() -> tuple[tuple[str, str], ...]:
    """The autocast contexts active now: (device type, dtype) of each enabled one."""
    active = []
    for device in _AUTOCAST_DEVICES:
        try:
            if torch.is_autocast_enabled(device):
                active.append((device, _dtype(torch.get_autocast_dtype(device))))
        except (RuntimeError, TypeError, AttributeError):  # a device this torch lacks
            continue
    return tuple(active)


@contextlib.contextmanager
def uncached_autocast() -> Iterator[None]:
    """The autocast state now, with its cache of cast weights off. Cached, a weight is cast
    (an op) at its first use in an autocast context and not at later ones, nor when
    checkpoint recomputes a block: an eager block would dispatch other ops at each call.
    Uncached, every use casts, in the forward and the recomputation alike."""
    with contextlib.ExitStack() as stack:
        for device, dtype in autocast_state():
            stack.enter_context(torch.autocast(device, dtype=getattr(torch, dtype),
                                               cache_enabled=False))
        yield


def describe_autocast(state: tuple[tuple[str, str], ...]) -> str:
    if not state:
        return "without autocast"
    return "under " + " and ".join(f"torch.autocast({device!r}, dtype=torch.{dtype})"
                                   for device, dtype in state)


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _name(key: str | int) -> str:
    return key if isinstance(key, str) else f"positional input {key}"


@dataclass(frozen=True)
class InputSpec:
    """One input of the planned call: a tensor's dtype, shape (each dimension a size, or the
    `DimRange` a named dimension takes) and device, or a plain value that the graph holds as
    a constant."""

    key: str | int
    dtype: str | None = None
    shape: tuple[int | DimRange, ...] = ()
    value: Any = None
    device: str | None = None

    @property
    def tensor(self) -> bool:
        return self.dtype is not None

    def describe(self) -> str:
        if not self.tensor:
            return f"{_name(self.key)}={self.value!r}"
        dims = ", ".join(str(d) if isinstance(d, int) else
                         f"{d.name} {d.lo}..{d.hi}" if not d.pinned else f"{d.name} {d.lo}"
                         for d in self.shape)
        return f"{_name(self.key)} {self.dtype} ({dims})"


@dataclass(frozen=True)
class CallSpec:
    """The causes of a planned training call's graph, as recorded when the plan was made."""

    inputs: tuple[InputSpec, ...]
    shape_range: ShapeRange | None
    autocast: tuple[tuple[str, str], ...]
    trainable: frozenset[str]
    param_dtypes: tuple[tuple[str, str], ...]
    training: bool = True
    """The model's mode when planned: a call in the other mode is not the planned step."""
    scalars_free: bool = False
    """Inputs without a dimension (plain values, 0-dim tensors) may come and go: an eager
    plan's blocks never see them. A compiled step traces each into its graph."""
    device_index: bool = True
    """An input must be on the planned device itself, not only one of its type: a compiled
    step runs where it was traced. An eager plan's policies go to other ranks, whose inputs
    are on other devices of the same type (cuda:1 for cuda:0)."""

    @classmethod
    def of(cls, model: torch.nn.Module, args: tuple, kwargs: dict,
           shape_range: ShapeRange | None, autocast: tuple[tuple[str, str], ...]) -> "CallSpec":
        """The spec of a call like ``model(*args, **kwargs)`` under `autocast` (the state the
        step was traced under), with the named dimensions of `shape_range` free in it."""
        specs = []
        for key, value in [*enumerate(args), *kwargs.items()]:
            if isinstance(value, torch.Tensor):
                shape: list[int | DimRange] = list(value.shape)
                for d in (shape_range.dims_of(key) if shape_range else ()):
                    shape[d.dim] = shape_range.range_of(d.name)
                specs.append(InputSpec(key, _dtype(value.dtype), tuple(shape),
                                       device=str(value.device)))
            else:
                specs.append(InputSpec(key, value=value if isinstance(value, _PLAIN) else None))
        return cls(inputs=tuple(specs), shape_range=shape_range, autocast=tuple(autocast),
                   trainable=frozenset(n for n, p in _named_parameters(model)
                                       if p.requires_grad),
                   param_dtypes=tuple((n, _dtype(p.dtype))
                                      for n, p in _named_parameters(model)),
                   training=model.training)

    # -- checking a call
    def check(self, model: torch.nn.Module, args: tuple, kwargs: dict, *,
              autocast: bool = True) -> None:
        """Raise RematError naming the first cause by which this call differs from the
        planned one (inputs, their dtypes and shapes, autocast, parameters that require grad,
        parameter dtypes), with the remedy; before any work is done. `autocast=False` leaves
        the autocast state to be checked where the planned ops run (a forward pre-hook runs
        outside a forward that accelerate wraps in its autocast)."""
        cause = self.cause(model, args, kwargs, autocast=autocast)
        if cause is not None:
            raise RematError(cause)

    def cause(self, model: torch.nn.Module, args: tuple, kwargs: dict, *,
              autocast: bool = True) -> str | None:
        return (self._inputs_cause(args, kwargs)
                or (self.autocast_cause() if autocast else None)
                or self.parameters_cause(model))

    def _inputs_cause(self, args: tuple, kwargs: dict) -> str | None:
        planned = [s.key for s in self.inputs]
        given = [*range(len(args)), *kwargs]
        if self.scalars_free:
            # Eager blocks see the batch, not the loss's scalars (the Trainer's
            # num_items_in_batch): only inputs with a dimension must be the planned ones.
            planned = [s.key for s in self.inputs if s.tensor and s.shape]
            given = sorted((k for k in given if _has_dims(_value(args, kwargs, k))), key=str)
            planned = sorted(planned, key=str)
        if planned != given:
            return (f"the call's inputs are {_keys(given)} but the plan was made for "
                    f"{_keys(planned)}: call the planned step with the inputs it was planned "
                    "with (the same keywords, in the same order), or plan again with these")
        for spec in self.inputs:
            if spec.key not in given:
                continue
            value = _value(args, kwargs, spec.key)
            cause = self._input_cause(spec, value)
            if cause is not None:
                return cause
        return self._agreement_cause(args, kwargs)

    def _input_cause(self, spec: InputSpec, value: Any) -> str | None:
        name = _name(spec.key)
        if not spec.tensor:
            if isinstance(value, torch.Tensor):
                return (f"{name} is a tensor but the plan was made with {spec.value!r} there; "
                        "plan again with the inputs you train with")
            if spec.value is not None and value != spec.value and isinstance(value, _PLAIN):
                return (f"{name} is {value!r} but the plan was made with {spec.value!r}: the "
                        "traced graph holds that value as a constant; plan again with it")
            return None
        if not isinstance(value, torch.Tensor):
            return (f"{name} is {type(value).__name__}, not the {spec.dtype} tensor the plan "
                    "was made for")
        cause = self._device_cause(name, spec, value)
        if cause is not None:
            return cause
        if _dtype(value.dtype) != spec.dtype:
            return (f"{name} is {_dtype(value.dtype)} but the plan was made for {spec.dtype}: "
                    f"cast it ({name}.to(torch.{spec.dtype})), or plan again with "
                    f"{_dtype(value.dtype)} inputs")
        if value.dim() != len(spec.shape):
            return (f"{name} has {value.dim()} dimensions, shape {tuple(value.shape)}, but the "
                    f"plan was made for {len(spec.shape)} ({spec.describe()})")
        for dim, (size, planned) in enumerate(zip(value.shape, spec.shape)):
            if isinstance(planned, DimRange):
                if not planned.lo <= size <= planned.hi:
                    other = (f"split the call into pieces of at most {planned.hi} along it"
                             if size > planned.hi else f"pad it to {planned.lo}")
                    return (f"{name} dim {dim} ({planned.name}) is {size}, outside the planned "
                            f"range {planned.lo}..{planned.hi}: no plan was made (nor its "
                            f"memory proven) for it; plan a range that holds it "
                            f"(optimize(..., dynamic={{{planned.name!r}: "
                            f"({min(planned.lo, size)}, {max(planned.hi, size)})}})), or "
                            f"{other}")
            elif size != planned:
                return (f"{name} dim {dim} is {size} but the plan was made for {planned} "
                        f"only: {_range_remedy(dim, planned, size)}")
        return None

    def _device_cause(self, name: str, spec: InputSpec, value: torch.Tensor) -> str | None:
        """An input on another device than planned (a 0-dim tensor may be on the CPU beside
        any device, as in eager PyTorch). Unchecked, the compiled step fails deep in its
        tracing (FakeTensorDeviceMismatchError), the eager blocks run other ops."""
        if spec.device is None or value.dim() == 0:
            return None
        planned, device = torch.device(spec.device), value.device
        if planned.type == device.type and (planned.index == device.index
                                            or not self.device_index):
            return None
        return (f"{name} is on {device} but the plan was made with it on {planned}: the step "
                f"was traced and planned there, with the model; move it there "
                f"({name}.to({str(planned)!r})), or plan again with the model and its inputs "
                f"on {device}")

    def _agreement_cause(self, args: tuple, kwargs: dict) -> str | None:
        if self.shape_range is None:
            return None
        seen: dict[str, tuple[int, str]] = {}
        for d in self.shape_range.dims:
            value = args[d.input] if isinstance(d.input, int) else kwargs.get(d.input)
            if not isinstance(value, torch.Tensor) or value.dim() <= d.dim:
                continue
            size = int(value.shape[d.dim])
            first = seen.setdefault(d.name, (size, str(d)))
            if first[0] != size:
                return (f"{d} is {size} but {first[1]} is {first[0]}; both are {d.name!r} in "
                        "the planned range, which must agree within a call")
        return None

    def autocast_cause(self, now: tuple | None = None) -> str | None:
        """Why the autocast state `now` (the current one by default) is not the planned."""
        now = autocast_state() if now is None else now
        if now == self.autocast:
            return None
        return (f"the call runs {describe_autocast(now)} but the plan was made "
                f"{describe_autocast(self.autocast)}: autocast changes the step's graph (its "
                "casts and dtypes), so the plan does not describe it; call it as it was "
                f"planned, or plan again {describe_autocast(now)} (remat.optimize inside the "
                "same autocast context)")

    def parameters_cause(self, model: torch.nn.Module, prefix: str = "") -> str | None:
        """The parameters (of `model`, whose names start with `prefix` in the planned model)
        that changed requires_grad or dtype since the plan was made."""
        params = [(prefix + n, p) for n, p in _named_parameters(model)]
        frozen = [n for n, p in params if not p.requires_grad and n in self.trainable]
        thawed = [n for n, p in params if p.requires_grad and n not in self.trainable]
        if frozen or thawed:
            changed, now = (frozen, "no longer require") if frozen else (thawed, "now require")
            return (f"{len(changed)} parameters {now} grad since the plan was made "
                    f"({', '.join(changed[:3])}{', ...' if len(changed) > 3 else ''}): the step "
                    "computes other gradients and holds other memory; set requires_grad "
                    "before remat.optimize and plan again")
        dtypes = dict(self.param_dtypes)
        cast = [(n, _dtype(p.dtype)) for n, p in params
                if n in dtypes and _dtype(p.dtype) != dtypes[n]]
        if cast:
            name, dtype = cast[0]
            return (f"parameter {name} is {dtype} but the plan was made for {dtypes[name]} "
                    f"({len(cast)} parameters changed dtype since): plan the model in the "
                    "dtype you train it in (cast it before remat.optimize)")
        return None

    # -- saying it
    def describe(self) -> str:
        return "; ".join(s.describe() for s in self.inputs)


def _named_parameters(model: torch.nn.Module):
    """`model`'s parameters by the names they had before torch.compile wrapped a module
    (`torch.compile(block)` puts the block under ``_orig_mod``, as per-block compile does)."""
    for name, p in model.named_parameters():
        yield name.replace("_orig_mod.", ""), p


def _value(args: tuple, kwargs: dict, key: str | int) -> Any:
    return args[key] if isinstance(key, int) else kwargs[key]


def _has_dims(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0


def _keys(keys: list) -> str:
    return "(" + ", ".join(_name(k) for k in keys) + ")" if keys else "(none)"


def _range_remedy(dim: int, planned: int, size: int) -> str:
    name = {0: "batch", 1: "seq"}.get(dim)
    low, high = min(planned, size), max(planned, size)
    if name is None:
        return (f"name it to plan a range of sizes (optimize(..., dynamic={{'size': ({low}, "
                f"{high})}}, dynamic_dims={{input: {{{dim}: 'size'}}}})), or call with {planned}")
    return (f"plan a range of sizes with optimize(..., dynamic={{{name!r}: ({low}, {high})}}) "
            "(one plan then serves every size in it, its memory proven at the largest), or "
            f"call with {planned}")
