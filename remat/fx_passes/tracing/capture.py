"""Capture a model's training step as one AOTAutograd joint forward+backward graph.

API
---
``capture(model, example_inputs=(), *, example_kwargs=None, loss_fn=None, name=None,
returns="loss") -> Captured``
    Traces ``loss = loss_fn(model(*example_inputs, **example_kwargs))`` with dynamo
    (``fullgraph=True``) and AOTAutograd (`remat.fx_passes.tracing.step_io`'s step, which with
    ``returns="output"`` also returns the model's output), and returns the joint graph that
    AOTAutograd hands to its ``partition_fn``: functional ATen, ``node.meta["val"]`` a fake
    tensor (or tuple of them) on every node.
    Nothing runs: the capture stops before the forward is compiled, so real parameters are
    not touched (BatchNorm statistics stay as they were). A model (or inputs) on the meta
    device is traced with fake tensors on ``fake_device`` ("cpu") standing in for its meta
    tensors: a 7B model is planned without allocating a weight.
    A graph break raises `CaptureError` naming the reason and the user's line; an error remat
    raises inside the trace (no loss, a loss that is not a scalar) reaches the caller as
    itself, and inputs the model rejects are named with their shapes (`step_io.diagnose`).
    Floating inputs of another dtype than the parameters are refused before tracing. Torch's
    logging is held back while tracing; a long capture logs its progress at INFO.

``compile_step(model, partition_fn, *, fw_compiler=None, bw_compiler=None, loss_fn=None)``
    The very same path with a caller's ``partition_fn`` (the rewrite, or PyTorch's
    ``default_partition``): returns a callable ``step(*args, **kwargs) -> loss`` whose backward is
    ``loss.backward()``. Because dynamo and AOTAutograd trace the same code the same way, the
    joint graph it partitions has the same node names as `Captured.graph_module`.

``default_loss(output)`` (from `remat.fx_passes.tracing.step_io`)
    The loss in the model's output: the output itself when it is a tensor, or its ``.loss``
    (Hugging Face ``ModelOutput``) / ``["loss"]`` / first element; a floating scalar.

`capture` and `compile_step` reset dynamo (``torch._dynamo.reset()``): captures never see each
other's caches or recompile limits. Hugging Face causal LMs whose ``loss_type`` is None
(GPT-2) warn in their loss lookup, a graph break: `capture` and the compiled step name the
loss they fall back to while they trace and run, and put the attribute back after (the Trainer
reads it to count the loss's tokens). A classification head's ``config.problem_type``, which
its first call sets, the compiled step sets before that call (`loss_type`).
"""
from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch import fx

from remat.errors import CaptureError, RematError
from remat.fx_passes.tracing.call_checks import autocast_state
from remat.fx_passes.tracing.dynamic import (Bucket, ShapeRange, concretize, mark, marked,
                                             tracing_sizes)
from remat.fx_passes.tracing.fake_weights import fake_meta_tensors
from remat.fx_passes.tracing.loss_type import (loss_types_named, problem_types_settled,
                                               unnamed_loss_types, unset_problem_types)
from remat.fx_passes.tracing.joint_passes import prepare_joint
from remat.fx_passes.tracing.profiler import compiles_unprofiled
from remat.fx_passes.tracing.step_io import (capture_failure, check_inputs, default_loss, progress,
                                     quiet_torch_logs, step_function)
from remat.fx_passes.tracing.unbacked import data_dependent_sizes

log = logging.getLogger(__name__)

__all__ = ["Captured", "capture", "compile_step", "default_loss", "make_backend"]


@dataclass
class Captured:
    """A captured training step.

    Fields
    ------
    graph_module: the joint graph ``forward(primals..., tangents...)`` as AOTAutograd gives it
        to a ``partition_fn``: outputs are the forward outputs, then one gradient (or None) per
        primal. Every node has ``meta["val"]``.
    num_fwd_outputs: how many leading outputs are forward outputs (mutated inputs' new values
        first, then the user's outputs: the loss).
    num_mutation_outputs: how many of those leading forward outputs are new values of inputs
        that the step mutates (BatchNorm running statistics); AOTAutograd copies them into the
        inputs after the forward.
    params: placeholder name -> parameter qualified name ("h.0.attn.c_attn.weight").
    buffers: placeholder name -> buffer qualified name.
    user_inputs: placeholder names of the example inputs, in order.
    tangents: placeholder names of the output gradients (the loss's tangent).
    mutated_inputs: placeholder names whose data the step writes.
    param_count, param_bytes: number and bytes of the parameters (each storage counted once).
    buffer_bytes, input_bytes: bytes of buffers and of the example inputs.
    model_name: the model's class name or the given name.
    input_shapes: shapes of the example inputs; dtype: the dtype of most parameter bytes.
    device: the device the parameters live on ("meta" for weight-free planning).
    capture_time: seconds the capture took.
    training: the model's mode (``model.training``) when captured: dropout and BatchNorm
        trace other graphs in eval mode, so a plan runs only in the mode it was made in.
    autocast: the autocast state traced under (`call_checks.autocast_state`).
    shape_range, bucket: the range of shapes and the bucket of it traced for, symbolic
        values in ``meta["symbolic_val"]`` (`remat.fx_passes.tracing.dynamic.concretize`).
    inductor: the graph is in Inductor's forms (`remat.fx_passes.tracing.inductor_forms`).
    """

    graph_module: fx.GraphModule
    num_fwd_outputs: int
    num_mutation_outputs: int = 0
    params: dict[str, str] = field(default_factory=dict)
    buffers: dict[str, str] = field(default_factory=dict)
    user_inputs: list[str] = field(default_factory=list)
    tangents: list[str] = field(default_factory=list)
    mutated_inputs: list[str] = field(default_factory=list)
    param_count: int = 0
    param_bytes: int = 0
    buffer_bytes: int = 0
    input_bytes: int = 0
    model_name: str = ""
    input_shapes: list[tuple[int, ...]] = field(default_factory=list)
    dtype: str = ""
    device: str = ""
    capture_time: float = 0.0
    training: bool = True
    autocast: tuple = ()
    shape_range: ShapeRange | None = None
    inductor: bool = False
    bucket: Bucket | None = None

    @property
    def graph(self) -> fx.Graph:
        return self.graph_module.graph

    @property
    def output_values(self) -> list[Any]:
        return list(self.graph.output_node().args[0])

    @property
    def forward_outputs(self) -> list[fx.Node]:
        return [v for v in self.output_values[: self.num_fwd_outputs] if isinstance(v, fx.Node)]

    @property
    def gradient_outputs(self) -> list[fx.Node]:
        return [v for v in self.output_values[self.num_fwd_outputs:] if isinstance(v, fx.Node)]

    @property
    def placeholders(self) -> list[fx.Node]:
        return list(self.graph.find_nodes(op="placeholder"))

    def summary(self) -> dict:
        return {"model": self.model_name, "nodes": len(self.graph.nodes),
                "params": self.param_count, "param_bytes": self.param_bytes,
                "inputs": self.input_shapes, "dtype": self.dtype, "device": self.device,
                "capture_time": self.capture_time}


def make_backend(partition_fn: Callable, *, fw_compiler: Callable | None = None,
                 bw_compiler: Callable | None = None, on_graph: Callable | None = None):
    """An AOTAutograd dynamo backend with these compilers (``boxed_nop`` by default: the graphs
    run op by op, freeing each value after its last use). ``on_graph(gm, example_inputs)`` sees
    dynamo's graph and its real inputs first."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.backends.debugging import boxed_nop

    aot = aot_autograd(fw_compiler=fw_compiler or boxed_nop, bw_compiler=bw_compiler or boxed_nop,
                       partition_fn=partition_fn)

    def backend(gm, example_inputs):
        if on_graph is not None:
            on_graph(gm, example_inputs)
        _exact_fake_storages(example_inputs)
        return aot(gm, example_inputs)

    return backend


def _exact_fake_storages(example_inputs) -> None:
    """Trace the joint graph with fake tensors whose storages are the real kernels'. Torch's
    fake-tensor dispatch cache remakes a cached op's output with its shape and strides but no
    storage offset (torch 2.13, `FakeTensorMode._get_output_tensor_from_cache_entry`): the
    second ``aten.copy`` into the same slice of a buffer (DeepSeek-V3's ``expand_kv``
    backward) then owned 139,264 bytes instead of the 139,776 its kernel allocates, and two
    captures of one model disagreed on an op's bytes, so that no plan of it could run. The
    cache is off for this trace only (dynamo's fake mode is made per trace)."""
    mode = torch._guards.detect_fake_mode(example_inputs)
    if mode is not None:
        mode.cache_enabled = False


def compile_step(model: torch.nn.Module, partition_fn: Callable, *,
                 fw_compiler: Callable | None = None, bw_compiler: Callable | None = None,
                 loss_fn: Callable | None = None, reset: bool = True,
                 returns: str = "loss", shape_range: ShapeRange | None = None,
                 bucket: Bucket | None = None) -> Callable:
    """``step(*args, **kwargs) -> loss`` (or the model's output, `returns`) compiled through
    `capture`'s path with ``partition_fn``; with `shape_range`, one graph for every call in
    `bucket`, its sizes symbolic as `capture` traces them."""
    if reset:
        torch._dynamo.reset()
    backend = make_backend(partition_fn, fw_compiler=fw_compiler, bw_compiler=bw_compiler)
    compiled = torch.compile(step_function(model, loss_fn, returns), backend=backend,
                             fullgraph=True, dynamic=False)
    if shape_range is not None:
        compiled = marked(compiled, shape_range, bucket)
    unnamed = unnamed_loss_types(model)
    heads = unset_problem_types(model)

    def step(*args, **kwargs):
        # Named at every call, as when captured: dynamo guards on the attribute. Sizes that
        # depend on the data are traced as capture traced them (a call may recompile), and
        # unseen by a profiler that would specialize them (profiler.py). A problem type the
        # first call would set is set before it (loss_type.py: else the second call compiles
        # again).
        problem_types_settled(heads, kwargs)
        with loss_types_named(unnamed), data_dependent_sizes(), compiles_unprofiled():
            return compiled(*args, **kwargs)

    return step


class _Stop(Exception):
    """Raised by the capturing compiler once everything is recorded: nothing needs to run."""


def capture(model: torch.nn.Module, example_inputs: Sequence[Any] = (), *,
            example_kwargs: dict[str, Any] | None = None, loss_fn: Callable | None = None,
            name: str | None = None, fake_device: str = "cpu",
            returns: str = "loss", shape_range: ShapeRange | None = None,
            inductor: bool = False) -> Captured:
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    example_inputs = tuple(example_inputs)
    example_kwargs = dict(example_kwargs or {})
    check_inputs(model, example_inputs, example_kwargs)
    bucket = None
    if shape_range is not None:
        # The example is the bucket's largest shape: the graph's values are taken there.
        bucket = shape_range.bucket_of(shape_range.sizes_of(example_inputs, example_kwargs))
        mark(example_inputs, example_kwargs, shape_range, bucket)
    start = time.perf_counter()
    seen: dict[str, Any] = {"device": next((str(p.device) for p in model.parameters()), "")}

    def on_graph(gm, inputs):
        seen["inputs"] = list(inputs)

    def partition_fn(joint, joint_inputs, *, num_fwd_outputs, **kwargs):
        from torch._functorch.partitioners import default_partition

        seen["joint"] = joint
        seen["num_fwd_outputs"] = num_fwd_outputs
        # The forward compiler below stops the compile; partitioning by default first lets
        # AOTAutograd publish its metadata (which inputs are mutated) before that.
        return default_partition(joint, joint_inputs, num_fwd_outputs=num_fwd_outputs, **kwargs)

    def fw_compiler(gm, inputs):
        context = torch._guards.TracingContext.try_get()
        seen["meta"] = getattr(context, "fw_metadata", None)
        raise _Stop()

    torch._dynamo.reset()
    backend = make_backend(partition_fn, fw_compiler=fw_compiler, on_graph=on_graph)
    step = step_function(model, loss_fn, returns)
    compiled = torch.compile(step, backend=backend, fullgraph=True, dynamic=False)
    label = name or type(model).__name__
    failure: Exception | None = None
    with fake_meta_tensors(model, (example_inputs, example_kwargs), fake_device) as faked, \
            loss_types_named(unnamed_loss_types(model)), quiet_torch_logs(), progress(label):
        args, kwargs = faked
        try:
            with torch.enable_grad(), data_dependent_sizes(), compiles_unprofiled(), (
                    tracing_sizes() if shape_range is not None else contextlib.nullcontext()):
                compiled(*args, **kwargs)
        except RematError:
            raise
        except Exception as e:  # dynamo wraps the backend's exceptions
            if not _is_stop(e):
                failure = e
        finally:
            torch._dynamo.reset()
        if failure is None:
            if "joint" not in seen:
                raise CaptureError("no backward graph was traced: the loss does not require "
                                   "grad (are all parameters frozen, or is the model under "
                                   "no_grad?)")
            if shape_range is not None:
                concretize(seen["joint"], shape_range, bucket, label)
            prepare_joint(seen["joint"], label, inductor=inductor)
            captured = _describe(model, args, kwargs, seen, name)
            captured.inductor = inductor
    if failure is not None:
        # Outside the fake-tensor context: the diagnosis makes fake tensors of its own.
        raise capture_failure(failure, step, example_inputs, example_kwargs) from failure
    captured.capture_time = time.perf_counter() - start
    captured.training = model.training
    captured.autocast = autocast_state()
    captured.shape_range, captured.bucket = shape_range, bucket
    log.info("captured %s: %d nodes in %.1f s", captured.model_name,
             len(captured.graph.nodes), captured.capture_time)
    return captured


def _is_stop(e: BaseException | None) -> bool:
    while e is not None:
        if isinstance(e, _Stop) or isinstance(getattr(e, "inner_exception", None), _Stop):
            return True
        e = e.__cause__ or e.__context__
    return False


def _flat_inputs(inputs: list, primals: int) -> list:
    """Dynamo's graph inputs, one per AOTAutograd primal: a tensor subclass (a DTensor
    parameter under tensor parallelism) enters as its inner tensors in `__tensor_flatten__`'s
    order, the subclass itself standing for the first (a DTensor's local shard); an opaque
    object (a DeviceMesh) as one. Unchanged when the counts do not add up."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    def count(x) -> int:
        if isinstance(x, torch.Tensor) and is_traceable_wrapper_subclass(x):
            return sum(count(getattr(x, name)) for name in x.__tensor_flatten__()[0])
        return 1

    counts = [count(x) for x in inputs]
    if sum(counts) != primals or len(counts) == primals:
        return inputs
    return [x if k == 0 else None for x, n in zip(inputs, counts) for k in range(n)]


def _describe(model, args, kwargs, seen, name) -> Captured:
    joint: fx.GraphModule = seen["joint"]
    num_fwd_outputs: int = seen["num_fwd_outputs"]
    placeholders = list(joint.graph.find_nodes(op="placeholder"))
    primals = [p for p in placeholders if not p.name.startswith("tangents")]
    tangents = [p.name for p in placeholders if p.name.startswith("tangents")]

    # A tied tensor is named as named_parameters() names it: by its first registration.
    by_id_param = {id(p): n for n, p in model.named_parameters()}
    by_id_buffer = {id(b): n for n, b in model.named_buffers()}
    inputs = _flat_inputs(seen.get("inputs", []), len(primals))
    params, buffers, user_inputs = {}, {}, []
    for i, p in enumerate(primals):
        value = inputs[i] if i < len(inputs) else None
        if id(value) in by_id_param:
            params[p.name] = by_id_param[id(value)]
        elif id(value) in by_id_buffer:
            buffers[p.name] = by_id_buffer[id(value)]
        else:
            user_inputs.append(p.name)
    if len(inputs) != len(primals):
        log.warning("dynamo passed %d inputs for %d primals; parameter names may be missing",
                    len(inputs), len(primals))

    meta = seen.get("meta")
    mutated, num_mutation_outputs = [], 0
    if meta is not None:
        mutated = [primals[i].name for i, info in enumerate(meta.input_info)
                   if i < len(primals) and (info.mutates_data or info.mutates_metadata)]
        num_mutation_outputs = int(meta.num_mutated_inp_runtime_indices)
    else:
        log.warning("AOTAutograd did not publish its metadata; input mutations are unknown")

    unique = {p.untyped_storage()._cdata if p.device.type != "meta" else id(p): p
              for p in model.parameters()}
    dtypes: dict[torch.dtype, int] = {}
    for p in unique.values():
        dtypes[p.dtype] = dtypes.get(p.dtype, 0) + p.numel() * p.element_size()
    tensors = [x for x in (*args, *kwargs.values()) if isinstance(x, torch.Tensor)]
    return Captured(
        graph_module=joint, num_fwd_outputs=num_fwd_outputs,
        num_mutation_outputs=num_mutation_outputs, params=params, buffers=buffers,
        user_inputs=user_inputs, tangents=tangents, mutated_inputs=mutated,
        param_count=sum(p.numel() for p in unique.values()),
        param_bytes=sum(dtypes.values()),
        buffer_bytes=sum(b.numel() * b.element_size() for b in model.buffers()),
        input_bytes=sum(x.numel() * x.element_size() for x in tensors),
        model_name=name or type(model).__name__,
        input_shapes=[tuple(x.shape) for x in tensors],
        dtype=str(max(dtypes, key=dtypes.get)).replace("torch.", "") if dtypes else "",
        device=seen.get("device", ""),
    )
