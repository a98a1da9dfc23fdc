"""Run a model's training step under a plan.

`planned_module(model, problem, schedule)` returns an `nn.Module` whose forward is the captured
training step (the model's loss, traced as `remat.fx_passes.tracing.capture` traces it) compiled with
AOTAutograd and `rewrite.partition_fn`: the forward and backward graphs execute the schedule.
Parameters, buffers, input mutations (BatchNorm running statistics) and tied weights stay the
model's own, handled by AOTAutograd as in any torch.compile'd model, so an optimizer built on
the original model trains it.

Measuring: a dispatch mode entered around a torch.compile'd call makes dynamo run the eager
code instead, silently: the compiled graphs never run. `PlannedModule.instrument(...)` enters
modes inside the compiled forward and backward graphs instead, and counts the graph calls so a
test can prove that the compiled graphs really ran.

Compiling: `compile=True` hands the partitioned graphs to Inductor (`remat.fx_passes.compiled.inductor`).
An outer `torch.compile(planned)` would trace into the step and partition the model again with
its own partitioner, silently dropping the plan; the step is therefore opaque
to dynamo: the outer compile runs it as one call, under remat's own compile. With
``fullgraph=True`` dynamo refuses the opaque call; `PlannedModule.__call__`, a frame dynamo
skips, turns that refusal into a RematError that names the remedy.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Iterator

import torch
from torch import nn

from remat.errors import RematError
from remat.fx_passes.compiled.call_checks import PlannedSteps, explained
from remat.fx_passes.compiled.inductor import conv_heavy, inductor_compilers
from remat.fx_passes.compiled.rewrite import Partition, partition_fn
from remat.fx_passes.tracing.plain import records_graph, refuse_backward, wrong_mode_message
from remat.fx_passes.tracing.step_io import remat_error, step_function
from remat.solvers.core.problem import Problem
from remat.solvers.core.schedule import Schedule

log = logging.getLogger(__name__)

__all__ = ["GraphCalls", "PlannedModule", "planned_module"]

# A reusable context manager (a dispatch mode), or a factory of them called at every graph call
# with "forward" or "backward".
Instrument = ContextManager | Callable[[str], ContextManager]


@dataclass
class GraphCalls:
    """How many times the compiled graphs ran while instrumented."""

    forward: int = 0
    backward: int = 0


@dataclass
class _Hooks:
    instruments: list[Instrument] = field(default_factory=list)
    calls: GraphCalls = field(default_factory=GraphCalls)


def _instrumented(compiler: Callable, phase: str, hooks: _Hooks) -> Callable:
    """A graph compiler whose compiled graph enters `hooks.instruments` at every call. Keeps the
    boxed calling convention: the graph receives the argument list itself and empties it, so
    the backward frees saved tensors as it goes."""

    def compile_graph(gm: torch.fx.GraphModule, example_inputs: Any) -> Callable:
        compiled = compiler(gm, example_inputs)
        boxed = getattr(compiled, "_boxed_call", False)

        def run(args: Any) -> Any:
            if not hooks.instruments:
                return compiled(args) if boxed else compiled(*args)
            setattr(hooks.calls, phase, getattr(hooks.calls, phase) + 1)
            with contextlib.ExitStack() as stack:
                for instrument in hooks.instruments:
                    stack.enter_context(instrument(phase) if callable(instrument)
                                        else instrument)
                if boxed:
                    return compiled(args)
                inputs = list(args)
                args.clear()
                return compiled(*inputs)

        run._boxed_call = True  # type: ignore[attr-defined]
        return run

    return compile_graph


class PlannedModule(nn.Module):
    """The training step of `model` under a schedule. `forward(*args, **kwargs)` returns what
    the captured step returns (the loss, or the model's output carrying it: `returns`);
    `loss.backward()` runs the planned backward. The wrapped model is
    a submodule: its parameters are this module's parameters."""

    def __init__(self, model: nn.Module, problem: Problem, schedule: Schedule, *,
                 compile: bool = False, loss_fn: Callable | None = None,
                 returns: str = "loss", training: bool | None = None,
                 call_spec: Any = None, buckets: dict | None = None):
        super().__init__()
        from torch._dynamo.backends.debugging import boxed_nop

        from remat.fx_passes.tracing.capture import compile_step

        self.model = model
        self.problem = problem
        self.schedule = schedule
        self.partitions: list[Partition] = []
        self._hooks = _Hooks()
        fw, bw = inductor_compilers(conv_heavy(problem)) if compile else (boxed_nop, boxed_nop)
        if compile:
            # Inductor plans its own buffers; only the boxed_nop path runs the schedule op by op.
            fw_compiler, bw_compiler = fw, bw
        else:
            fw_compiler = _instrumented(fw, "forward", self._hooks)
            bw_compiler = _instrumented(bw, "backward", self._hooks)
        shape_range = call_spec.shape_range if call_spec is not None else None

        def make(problem: Problem, schedule: Schedule, bucket: Any) -> Callable:
            return _opaque_to_dynamo(explained(compile_step(
                model, partition_fn(problem, schedule, self.partitions.append,
                                    shape_range=shape_range),
                fw_compiler=fw_compiler, bw_compiler=bw_compiler, loss_fn=loss_fn, reset=False,
                returns=returns, shape_range=shape_range, bucket=bucket), bucket))

        self._steps = PlannedSteps(make, problem, schedule, call_spec, buckets)
        self.compiled = compile
        self.training_mode = training
        """The mode (``model.training``) the plan was made in, None if unknown."""
        # What a call without the plan returns: the model's own output, or the loss where the
        # planned step returns the loss.
        self._plain = model if returns == "output" and loss_fn is None \
            else step_function(model, loss_fn, returns)

    @torch.compiler.disable(recursive=False)
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # Dynamo skips this frame (not the calls it makes), so an outer torch.compile's
        # refusal to trace the opaque step surfaces here, where it can be explained.
        from torch._dynamo.exc import Unsupported

        try:
            return super().__call__(*args, **kwargs)
        except Unsupported as e:
            raise RematError(_FULLGRAPH_REFUSED) from e

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The model's inputs: `planned_module` makes the module of a subclass whose forward
        carries the model's signature (`_signed`)."""
        # Evaluation (no_grad, inference_mode, nothing requiring grad) keeps nothing for a
        # backward: the model runs itself. The other mode than the plan's traces other ops
        # (dropout, BatchNorm): it runs itself too, and only a backward through it is refused.
        if not records_graph(self.model.parameters(), args, kwargs):
            return self._plain(*args, **kwargs)
        if self.training_mode is not None and self.model.training != self.training_mode:
            return refuse_backward(self._plain(*args, **kwargs),
                                   wrong_mode_message(self.training_mode, self.model.training))
        # A training call: what changed since the plan was made is named before anything runs.
        self._steps.check(self.model, args, kwargs)
        step = self._steps.step_for(self.model, args, kwargs)
        try:
            return step(*args, **kwargs)
        except Exception as e:
            inner = remat_error(e)
            if inner is not None and inner is not e:
                raise inner from e
            raise

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """The model's own ``generate`` (Hugging Face): generation records no graph, so it
        runs the model plainly, as `forward` does under ``torch.no_grad()``."""
        return self.model.generate(*args, **kwargs)

    @property
    def partition(self) -> Partition:
        """The forward and backward graphs of the latest compilation."""
        if not self.partitions:
            raise RematError("the planned step has not run yet: call it once (with grad "
                             "enabled) to compile it")
        return self.partitions[-1]

    @contextlib.contextmanager
    def instrument(self, *instruments: Instrument) -> Iterator[GraphCalls]:
        """Enter each instrument (or `instrument(phase)` for a factory) inside every call of
        the compiled forward and backward graphs while this context is active. Yields the
        call counts, which prove that the compiled graphs ran."""
        if self.compiled:
            raise RematError("instrument() needs the op-by-op graphs: build the planned module "
                             "with compile=False")
        before = list(self._hooks.instruments)
        self._hooks.instruments.extend(instruments)
        self._hooks.calls = GraphCalls()
        try:
            yield self._hooks.calls
        finally:
            self._hooks.instruments[:] = before


def planned_module(model: nn.Module, problem: Problem, schedule: Schedule, *,
                   compile: bool = False, loss_fn: Callable | None = None,
                   returns: str = "loss", training: bool | None = None,
                   call_spec: Any = None, buckets: dict | None = None) -> PlannedModule:
    """`model`'s training step running `schedule`: op by op (`compile=False`, the graphs that
    can be measured against the simulator), or through Inductor (`compile=True`). `problem`
    must be the one lowered from `capture(model, args, example_kwargs=kwargs, loss_fn=loss_fn,
    returns=returns)` for inputs of the shapes the module is called with; anything else raises
    RematError at the first call. `returns`: "loss" (the forward returns the loss tensor) or
    "output" (the model's output with the loss attached to the plan, other tensors detached;
    see `remat.fx_passes.tracing.step_io`). `training`: the mode the plan was made in; a call in
    the other mode runs the model itself, and a backward through it raises RematError saying
    so. Calls that record no autograd graph (``torch.no_grad()``, ``torch.inference_mode()``,
    nothing requiring grad) run the model itself, without the plan
    (`remat.fx_passes.tracing.plain`). `call_spec`
    (`remat.fx_passes.tracing.call_checks.CallSpec`): what a training call must look like,
    checked before each; with a range of shapes, `buckets` gives each bucket's problem and
    schedule (`remat.fx_passes.compiled.call_checks`)."""
    return _signed(type(model))(model, problem, schedule, compile=compile, loss_fn=loss_fn,
                                returns=returns, training=training, call_spec=call_spec,
                                buckets=buckets)


@functools.cache
def _signed(model_class: type) -> type:
    """PlannedModule with `model_class`'s forward signature, named ``Planned<model class>``.
    The planned step takes the model's inputs, and callers read them from the class's
    signature: Hugging Face's Trainer keeps the dataset columns it names (``(*args,
    **kwargs)`` names none: its batches are left empty) and finds the labels there to compute
    an evaluation loss (``find_labels``, which also reads "QuestionAnswering" in the name).
    PlannedModule itself where the model's signature cannot be read."""
    try:
        signature = inspect.signature(model_class.forward)
    except (TypeError, ValueError):
        return PlannedModule

    def forward(self: PlannedModule, *args: Any, **kwargs: Any) -> Any:
        return PlannedModule.forward(self, *args, **kwargs)

    forward.__signature__ = signature  # type: ignore[attr-defined]
    forward.__doc__ = PlannedModule.forward.__doc__
    return type(f"Planned{model_class.__name__}", (PlannedModule,),
                {"forward": forward, "__module__": __name__, "__doc__": PlannedModule.__doc__})


_OPAQUE_REASON = ("remat's planned step is compiled with its own partitioner, and an outer "
                  "torch.compile tracing into it would partition the model again and drop the "
                  "plan; so the step is opaque to it. Without fullgraph=True the outer compile "
                  "runs the step as one call, plan kept; to compile the step itself with "
                  "Inductor, plan with remat.optimize(..., compile=True)")


_FULLGRAPH_REFUSED = (
    "torch.compile(..., fullgraph=True) of a planned module: the planned step is compiled "
    "with remat's own partitioner and is opaque to an outer torch.compile (tracing into it "
    "would partition the model again and drop the plan), so it cannot be one full graph. "
    "Call plan.module directly (it is already compiled, the plan kept), compile it without "
    "fullgraph=True (the step then runs as one call, plan kept), or plan with "
    "remat.optimize(..., compile=True) to have Inductor compile the planned graphs")


def _opaque_to_dynamo(step: Callable) -> Callable:
    """`step` as a call that an outer `torch.compile` cannot trace into. Tracing into it would
    inline the model's code and partition it again with the outer backend's partitioner: the
    plan silently dropped. Disabled, the call is a graph break, and the step
    runs under its own compile, with remat's partitioner. `disable` would unwrap a compiled
    function to its original code, so the compiled step is called through a closure."""

    def run_planned_step(*args: Any, **kwargs: Any) -> Any:
        return step(*args, **kwargs)

    try:
        return torch._dynamo.disable(run_planned_step, reason=_OPAQUE_REASON)
    except TypeError:  # a torch whose disable takes no reason
        return torch._dynamo.disable(run_planned_step)

