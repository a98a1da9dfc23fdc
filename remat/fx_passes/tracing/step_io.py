"""What a captured training step takes and returns, checked where the user can be told plainly.

`capture` traces ``step(*args, **kwargs)``: the model's forward, then its loss. This module
builds that step and says what is wrong with it in the user's terms:

- `step_function(model, loss_fn, returns)`: the step; ``returns="loss"`` gives the loss tensor,
  ``returns="output"`` the model's own output (a Hugging Face ``ModelOutput``, dict, tuple or
  tensor) whose loss is the planned step's loss and whose other tensors are detached (the
  plan's backward starts from the loss alone, so nothing else can be differentiated).
- `default_loss(output)`: the loss found in the output: the output itself when it is a tensor,
  its ``.loss`` / ``["loss"]`` / first element otherwise; it must be a scalar.
- `check_inputs(model, args, kwargs)`: floating inputs in a dtype the parameters do not have
  are refused before tracing (eager PyTorch fails at the first matmul; a plan would fail later).
- `diagnose(step, args, kwargs)`: after dynamo failed, the step run eagerly on fake tensors. An
  error remat raised inside dynamo's trace comes out as an "observed exception" graph break;
  raised here it reaches the user as itself, and torch's own errors (wrong shapes) come with
  the inputs' names, dtypes and shapes.
- `quiet_torch_logs()` and `progress(name)`: dynamo's logging held back while capturing (the
  error says what matters), and an INFO line every few seconds of a long capture.
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time
import traceback
import types
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from remat.errors import CaptureError, RematError
from remat.fx_passes.tracing.torch_version import torch_at_least

log = logging.getLogger(__name__)

RETURNS = ("loss", "output")
PROGRESS_EVERY = 5.0  # seconds between progress lines of a long capture

# Loggers whose records a failed trace floods the terminal with (fake tensor tracebacks,
# dynamo's graph-break reports); the CaptureError carries what matters of them.
_TORCH_LOGGERS = ("torch._dynamo", "torch._subclasses", "torch._functorch", "torch.fx",
                  "torch._inductor", "torch._guards", "torch._export")


def default_loss(output: Any) -> torch.Tensor:
    loss, where = output, "the tensor the model returned"
    if not isinstance(output, torch.Tensor):
        loss, where = getattr(output, "loss", None), "its .loss"
        if loss is None and isinstance(output, dict):
            loss, where = output.get("loss"), "its ['loss']"
        if loss is None and isinstance(output, (tuple, list)) and output:
            loss, where = output[0], "its first element"
    if not isinstance(loss, torch.Tensor):
        raise CaptureError(
            f"the model returned {type(output).__name__} without a loss tensor; return a scalar "
            "loss (a Hugging Face model returns .loss when given labels=), or pass loss_fn= to "
            "compute it from the output")
    if not isinstance(output, torch.Tensor):
        where = f"{where} of the {type(output).__name__} the model returned"
    check_loss(loss, where)
    return loss


def check_loss(loss: Any, what: str) -> None:
    """A loss is a floating scalar tensor: anything else (logits taken for the loss) would be
    planned, then fail at ``backward()``."""
    if not isinstance(loss, torch.Tensor):
        raise CaptureError(f"loss_fn returned {type(loss).__name__}, not a tensor; return the "
                           "scalar loss")
    if loss.dim() != 0 or not loss.is_floating_point():
        raise CaptureError(
            f"the loss ({what}) is a {str(loss.dtype).replace('torch.', '')} tensor of shape "
            f"{tuple(loss.shape)}, not a floating scalar; pass loss_fn= to compute the scalar "
            "loss from the model's output (e.g. loss_fn=lambda out: out[1] for a model "
            "returning (logits, loss))")


def step_function(model: torch.nn.Module, loss_fn: Callable | None, returns: str) -> Callable:
    """The step dynamo traces, with a code object of its own. Dynamo keeps compiled entries per
    code object, at most `recompile_limit` of them, and fullgraph=True fails past it: sharing
    one code object, the ninth planned step alive at once would fail, and resetting dynamo
    between them would make the others recompile."""
    if returns not in RETURNS:
        raise ValueError(f"returns={returns!r}: give one of {RETURNS}")

    def step(*args, **kwargs):
        output = model(*args, **kwargs)
        if loss_fn is None:
            loss = default_loss(output)
        else:
            loss = loss_fn(output)
            check_loss(loss, "what loss_fn returned")
        if returns == "loss" or loss_fn is not None or isinstance(output, torch.Tensor):
            return loss
        return with_loss(output, loss)

    return types.FunctionType(step.__code__.replace(), step.__globals__, step.__name__,
                              step.__defaults__, step.__closure__)


def with_loss(output: Any, loss: torch.Tensor) -> Any:
    """`output` with its tensors other than `loss` detached: they are returned to the caller
    (and held, as eager holds them, until the caller drops them) but not differentiated.

    Also the tensors an object in the output holds (a Hugging Face key/value cache: its
    layers' ``keys`` and ``values``). Left attached, each would be an output of the compiled
    step with a gradient input of its own, which autograd fills with zeros at the start of
    the backward: the cache's bytes a second time, in no plan (+46,592 bytes on a two-layer
    Llama, the T5 decoder's self and cross K/V on T5)."""

    def keep(value):
        if isinstance(value, torch.Tensor):
            return value.detach() if value is not loss else value
        _detach_held(value, depth=3)
        return value

    if isinstance(output, dict):  # ModelOutput is an OrderedDict whose items are its fields
        for key in list(output.keys()):
            output[key] = keep(output[key])
        return output
    if isinstance(output, tuple):
        items = [keep(v) for v in output]
        return type(output)(*items) if hasattr(output, "_fields") else tuple(items)
    if isinstance(output, list):
        return [keep(v) for v in output]
    return loss


def _detach_held(value: Any, depth: int) -> None:
    """Detach, in place, the tensors that `value` (an object other than a module, or a list or
    tuple of them) holds in its attributes, `depth` levels of objects deep (a cache, its
    layers, their keys)."""
    if depth == 0 or isinstance(value, (torch.nn.Module, str, bytes, int, float, bool,
                                        type(None), type)):
        return
    if isinstance(value, (list, tuple)):
        for item in value:
            _detach_held(item, depth)
        return
    if isinstance(value, dict) or not hasattr(value, "__dict__"):
        return  # a dict in the output was handled by `with_loss`; a plain value holds nothing
    for name, item in _attributes(value):
        if isinstance(item, torch.Tensor):
            if item.requires_grad:
                setattr(value, name, item.detach())
        else:
            _detach_held(item, depth - 1)


# Where dynamo cannot list an object's attributes (torch 2.11: `vars(cache).items()` is an
# unsupported call, a graph break), these are looked up by name: Hugging Face's caches
# (EncoderDecoderCache's two caches, DynamicCache's layers, a layer's keys and values, and the
# older caches' lists).
_LISTED = torch_at_least(2, 13)
_HELD_NAMES = ("self_attention_cache", "cross_attention_cache", "layers", "keys", "values",
               "key_cache", "value_cache")


def _attributes(value: Any) -> list[tuple[str, Any]]:
    """(name, value) of `value`'s attributes: all of them, or on a torch whose dynamo cannot
    list them, those of `_HELD_NAMES` it has."""
    if _LISTED:
        return list(vars(value).items())
    return [(name, getattr(value, name)) for name in _HELD_NAMES if hasattr(value, name)]


def check_inputs(model: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    """Refuse floating inputs in a dtype no floating parameter has: eager PyTorch fails at the
    first matmul ("mat1 and mat2 must have the same dtype"); a plan would fail at its first call
    after minutes of planning."""
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    if not dtypes:
        return
    for name, value in named_inputs(args, kwargs):
        if isinstance(value, torch.Tensor) and value.is_floating_point() \
                and value.dtype not in dtypes:
            have = ", ".join(sorted(_dtype(d) for d in dtypes))
            raise CaptureError(
                f"input {name} is {_dtype(value.dtype)} but the model's parameters are {have}: "
                f"the model would fail on it in eager PyTorch too; cast the input "
                f"({name}.to(torch.{_dtype(next(iter(dtypes)))})) or the model "
                f"(model.to(torch.{_dtype(value.dtype)})) so that they agree")


def named_inputs(args: tuple, kwargs: dict) -> list[tuple[str, Any]]:
    return [(f"example_inputs[{i}]", v) for i, v in enumerate(args)] + \
        [(f"example_kwargs[{k!r}]", v) for k, v in kwargs.items()]


def describe_inputs(args: tuple, kwargs: dict) -> str:
    def one(value):
        if isinstance(value, torch.Tensor):
            return f"{_dtype(value.dtype)} {tuple(value.shape)}"
        return type(value).__name__
    return "; ".join(f"{name}: {one(v)}" for name, v in named_inputs(args, kwargs)) or "none"


def diagnose(step: Callable, args: tuple, kwargs: dict) -> RematError | None:
    """Run `step` eagerly on fake tensors (nothing is computed or changed) to find the error
    that made dynamo fail: remat's own error, or torch's error on these inputs. None when the
    step runs eagerly: the failure is dynamo's (a graph break)."""
    from torch._subclasses import fake_tensor

    unknowable = (fake_tensor.DataDependentOutputException,
                  fake_tensor.DynamicOutputShapeException,
                  fake_tensor.UnsupportedOperatorException)
    try:
        with quiet_torch_logs(), fake_tensor.FakeTensorMode(allow_non_fake_inputs=True), \
                torch.enable_grad():
            step(*args, **kwargs)
    except RematError as e:
        return e
    except unknowable:  # the data itself decides: only dynamo's trace can say more
        return None
    except Exception as e:
        reason = next((line.strip() for line in str(e).splitlines() if line.strip()), "")
        where = _user_frame(e)
        return CaptureError(
            f"the model fails on these inputs, in eager PyTorch too: {type(e).__name__}: "
            f"{reason}\n  inputs: {describe_inputs(args, kwargs)}"
            + (f"\n  at: {where}" if where else "")
            + "\n  remedy: give example inputs of the shapes and dtypes the model takes "
              "(call model(...) on them eagerly to check)")
    return None


def odd_inputs(args: tuple, kwargs: dict) -> list[str]:
    """Inputs that are neither tensors nor Python scalars: dynamo specializes on them or
    cannot trace them at all."""
    plain = (torch.Tensor, int, float, bool, str, type(None))
    return [f"{name} ({type(v).__name__})" for name, v in named_inputs(args, kwargs)
            if not isinstance(v, plain)]


@contextlib.contextmanager
def quiet_torch_logs() -> Iterator[None]:
    loggers = [logging.getLogger(name) for name in _TORCH_LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


@contextlib.contextmanager
def progress(name: str, every: float | None = None) -> Iterator[None]:
    """Log "capturing NAME: N graph nodes traced, T s" every `every` seconds (PROGRESS_EVERY)
    until the block ends. The count is of fx nodes created (dynamo's graph, then AOTAutograd's joint graph),
    counted by wrapping `fx.Graph.create_node` for the duration of the block only."""
    from torch import fx

    created = [0]
    original = fx.Graph.create_node

    def counting(self, *args, **kwargs):
        created[0] += 1
        return original(self, *args, **kwargs)

    every = PROGRESS_EVERY if every is None else every
    done = threading.Event()
    start = time.perf_counter()

    def report():
        while not done.wait(every):
            log.info("capturing %s: %d graph nodes traced, %.0f s", name, created[0],
                     time.perf_counter() - start)

    fx.Graph.create_node = counting
    thread = threading.Thread(target=report, name="remat-capture-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        fx.Graph.create_node = original
        thread.join()


def capture_failure(failure: Exception, step: Callable, args: tuple,
                     kwargs: dict) -> RematError:
    """What the user is told when dynamo failed: remat's own error raised inside the trace (a
    graph break to dynamo), torch's error on these inputs (with their shapes), or the graph
    break itself."""
    inner = remat_error(failure)
    if inner is not None:
        return inner
    found = diagnose(step, args, kwargs)
    if found is not None:
        return found
    error = _graph_break(failure)
    odd = odd_inputs(args, kwargs)
    if odd:
        error = CaptureError(f"{error}\nnot tensors: {', '.join(odd)}; remat traces tensors "
                             "and Python scalars: pass these as tensors")
    return error


def remat_error(e: BaseException | None) -> RematError | None:
    """The RematError that dynamo wrapped (it re-raises errors of traced code and backends as
    its own)."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, RematError):
            return e
        inner = getattr(e, "inner_exception", None)
        if isinstance(inner, RematError):
            return inner
        e = e.__cause__ or e.__context__
    return None


def _graph_break(e: Exception) -> CaptureError:
    text = str(e)
    reason = next((line.strip() for line in text.splitlines() if line.strip()), type(e).__name__)
    where = ""
    if "from user code:" in text:
        frames = text.split("from user code:", 1)[1].strip().split("\n\n", 1)[0].splitlines()
        # The innermost frame is the line that broke; dynamo lists outermost first.
        files = [i for i, line in enumerate(frames) if line.strip().startswith("File ")]
        if files:
            where = "\n  ".join(line.rstrip() for line in frames[files[-1]:files[-1] + 2])
    from torch._dynamo import exc

    breaks = (exc.Unsupported, exc.UserError)
    if isinstance(e, breaks) and not isinstance(e, exc.TorchRuntimeError):
        message = f"the model cannot be captured as one graph (graph break): {reason}"
        hint = ("remat plans the whole training step as one graph; remove the break (no "
                ".item(), print or data-dependent Python branches in forward) and retry.")
        if "data-dependent expression" in text:
            hint = ("how many ops the step runs, or their shapes, depend on the data (a Python "
                    "loop over nonzero() or torch.where(mask), as mixture-of-experts layers "
                    "that loop over the experts a batch hits, like DBRX's): one graph cannot "
                    "hold that step; loop over a fixed range (every expert) or use experts "
                    "of static shapes (transformers: experts_implementation=\"batched_mm\" "
                    "where the model offers it), and retry.")
            if "modeling_dbrx.py" in where and "expert_hit" in where:
                hint = ("transformers' DbrxExperts loops `for expert_idx in expert_hit`, over "
                        "the experts this batch hits: a loop whose length is read from the "
                        "data, which one graph cannot hold, and DBRX offers no "
                        "experts_implementation. Call remat.every_expert(model) before "
                        "optimize: it makes each DbrxExperts loop over range(num_experts) "
                        "(an expert no token picked adds nothing: the same loss and "
                        "gradients), and retry.")
    else:
        message = f"tracing the training step failed: {reason}"
        hint = "check that the model runs eagerly on these inputs."
    if where:
        message += f"\nat:\n  {where}"
    return CaptureError(f"{message}\n{hint}")


def _user_frame(e: BaseException) -> str:
    """The innermost frame of the traceback outside torch and remat: the user's line."""
    import remat

    skip = (str(Path(torch.__file__).parent), str(Path(remat.__file__).parent))
    frames = [f for f in traceback.extract_tb(e.__traceback__)
              if not f.filename.startswith(skip)]
    if not frames:
        return ""
    frame = frames[-1]
    return f'File "{frame.filename}", line {frame.lineno}: {(frame.line or "").strip()}'


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")
