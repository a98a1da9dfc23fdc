"""`prepare(model, inputs)`: the half of `optimize` done once per model and batch shape.

Capture, profile and lower the step (replicating repeated blocks where the weights cannot run
anyway), add the collectives of sharded training, and compute the state the step holds: a
`Prepared`, which `plan_prepared` (remat.planner.optimize) solves at any number of budgets.
The checks of the model's parameters that planning and applying share live here too.
"""
from __future__ import annotations

import dataclasses

import inspect
import logging
import time
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Callable, Sequence

from remat.errors import RematError
from remat.planner.job import accounting
from remat.planner.job.accounting import StepMemory
from remat.planner.job.training import StateMemory, Training, state_memory
from remat.solvers import Problem, Schedule, Strategy, solve
from remat.solvers.core.collector import frozen_heap

log = logging.getLogger(__name__)

# The baselines the report sets beside the plan.
BASELINES = (Strategy.SAVE_ALL, Strategy.CHECKPOINT_BLOCKS)


@dataclass(frozen=True)
class Prepared:
    """A model's training step, captured, profiled and lowered, with its state: everything that
    does not depend on the budget."""

    problem: Problem
    """The problem the solver plans: the graph's ops, and under ZeRO-2/3 the collectives too."""
    captured: Any  # remat.fx_passes.tracing.capture.Captured
    profile: Any  # remat.fx_passes.measuring.profile_pass.Profile
    state: StateMemory
    training: Training
    gradients_in_graph: bool
    param_shapes: dict[str, tuple[tuple[int, ...], str]]
    """name -> (shape, dtype) of the parameters the plan was made for."""
    loss_fn: Callable | None = None
    meta_weights: bool = False
    """The parameters have no data (meta or fake): the plan cannot run on them."""
    inputs: tuple = ()
    """The example inputs as (shape, dtype) for tensors, the value itself otherwise: enough to
    capture the same step again on another device."""
    kwargs: dict = field(default_factory=dict)
    """The example keyword inputs, in the same form as `inputs`."""
    returns: str = "output"
    """What the planned module returns: "output" (the model's) or "loss"."""
    prepare_time: float = 0.0
    phases: tuple[tuple[str, float], ...] = ()
    """(phase, wall seconds) of the preparation: capture, profile, lower (the report's
    "time by phase", with the solve's)."""
    sharded: Any = None
    """remat.fx_passes.lowering.sharding.Sharded: `problem` and the graph problem the rewrite runs."""
    call_spec: Any = None
    """remat.fx_passes.tracing.call_checks.CallSpec: what a training call of the plan must be."""
    range_proof: Any = None
    """remat.fx_passes.lowering.shape_bound.RangeProof, for a step traced for a range of
    shapes: how its problem bounds every shape of the range."""

    def with_host_link(self, bandwidth: float, host_memory: int | None = None) -> "Prepared":
        """The same step, with saved values allowed to live in host memory between the forward
        and the backward, their bytes crossing a link of `bandwidth` bytes/s each way, at most
        `host_memory` bytes of them (None: no bound)."""
        link = dict(host_bandwidth=bandwidth, host_capacity=host_memory)
        problem = dataclasses.replace(self.problem, **link)
        sharded = self.sharded
        if sharded is not None:
            graph = (problem if sharded.graph is sharded.problem
                     else dataclasses.replace(sharded.graph, **link))
            sharded = dataclasses.replace(sharded, problem=problem, graph=graph)
        return dataclasses.replace(self, problem=problem, sharded=sharded)

    @cached_property
    def graph_gradients(self) -> int:
        """Bytes of the graph's gradients that the state counts (remat.planner.job.accounting)."""
        return accounting.graph_gradients(self.problem) if self.gradients_in_graph else 0

    @cached_property
    def baselines(self) -> dict[Strategy, Schedule]:
        """The baselines' schedules, whatever their peak (the report shows whether they fit)."""
        unbounded = sum(op.size + op.temp for op in self.problem.ops)
        return {s: solve(self.problem, unbounded, s) for s in BASELINES}

    def step_memory(self, schedule: Schedule, budget: int | None) -> StepMemory:
        return accounting.step_memory(schedule, self.state, self.training,
                                      graph_gradients=self.graph_gradients,
                                      gradients_in_graph=self.gradients_in_graph, budget=budget)

    def allowance(self, budget: int | None, activation_budget: int | None = None) -> int:
        """The simulated peak the solver may reach: the activations' share of a whole-step
        `budget` (or `activation_budget`), plus the graph's gradients the state counts."""
        if budget is None:
            return activation_budget + self.graph_gradients
        return (accounting.activation_allowance(budget, self.state, self.training)
                + self.graph_gradients)

    def needs(self, simulated_peak: int) -> int:
        """The smallest whole-step budget that holds a schedule of this simulated peak."""
        return accounting.smallest_budget(simulated_peak - self.graph_gradients, self.state,
                                          self.training)


@frozen_heap()  # the user's heap and the capture's graphs stay out of the collector's scans
def prepare(model: Any, example_inputs: Sequence[Any] = (), *,
            example_kwargs: dict[str, Any] | None = None, training: Training = Training(),
            target: str = "h100", loss_fn: Callable | None = None,
            returns: str = "output", replicate: bool | None = None,
            progress: Callable[[str, float], None] | None = None,
            shape_range: Any = None, inductor: bool = False) -> Prepared:
    """Capture, profile and lower the step once; compute the state it holds. `replicate`
    traces three blocks of a stack of equal ones and replicates the middle one
    (remat.fx_passes.tracing.replicate): the same problem in a fraction of the time, for planning;
    None: when the weights are meta or fake (a plan that cannot run as it is).
    `progress(phase, seconds)` hears of each phase as it ends. `shape_range`
    (remat.fx_passes.tracing.dynamic.ShapeRange): trace the step for the bucket of this range
    that the example inputs are the largest shape of, its sizes symbolic, and bound the
    problem over the bucket (remat.fx_passes.lowering.shape_bound). `inductor`: for a plan
    Inductor compiles (`remat.fx_passes.tracing.inductor_forms`)."""
    from remat.fx_passes.lowering.lower import lower
    from remat.fx_passes.lowering.shape_bound import bound_range
    from remat.fx_passes.measuring.profile_pass import profile
    from remat.fx_passes.tracing.call_checks import CallSpec
    from remat.fx_passes.tracing.capture import capture
    from remat.fx_passes.tracing.replicate import capture_replicated

    from remat.planner.job.tensor_layout import check_tensor_parallel

    check_tensor_parallel(model, training)  # before the capture: a mismatch is the user's
    start = time.perf_counter()
    log.info("capturing the training step of %s", type(model).__name__)
    if replicate is None:
        replicate = has_meta_weights(model)
    if shape_range is not None and replicate:
        raise RematError("a range of shapes is traced whole: replicate=True cannot serve it")
    ranged = {} if shape_range is None else {"shape_range": shape_range}
    if inductor:
        ranged["inductor"] = True
    captured = (capture_replicated if replicate else capture)(
        model, example_inputs, example_kwargs=example_kwargs, loss_fn=loss_fn, returns=returns,
        **ranged)
    phases: list[tuple[str, float]] = []

    def done(phase: str, seconds: float) -> None:
        phases.append((phase, seconds))
        if progress is not None:
            progress(phase, seconds)

    done("capture", captured.capture_time)
    log.info("profiling %d nodes for %s", len(captured.graph.nodes), target)
    profiled = profile(captured, target=target)
    done("profile", profiled.profile_time)
    lowering = time.perf_counter()
    lowered, proof = lower(captured), None
    if captured.shape_range is not None:
        lowered, proof = bound_range(lowered, captured)
    sharded = shard_step(lowered, captured, training)
    problem = sharded.problem
    done("lower", time.perf_counter() - lowering)
    log.info("lowered to %d ops (%d forward), %d candidates", len(problem),
             problem.num_forward, len(problem.candidates))
    state = dataclasses.replace(state_memory(model, training), batch=captured.input_bytes,
                                buffers=captured.buffer_bytes)
    _warn_on_mismatch(model, training)
    # Sharded gradients are made in the optimizer's dtype (remat.fx_passes.lowering.sharding).
    in_graph = training.zero_stage >= 2 or _gradients_in_graph(model, training)
    return Prepared(problem=problem, captured=captured, profile=profiled, state=state,
                    training=training, gradients_in_graph=in_graph, sharded=sharded,
                    param_shapes=_param_shapes(model), loss_fn=loss_fn,
                    meta_weights=has_meta_weights(model), inputs=_input_specs(example_inputs),
                    kwargs={k: _input_specs((v,))[0] for k, v in (example_kwargs or {}).items()},
                    returns=returns, prepare_time=time.perf_counter() - start,
                    phases=tuple(phases),
                    call_spec=CallSpec.of(model, _as_tuple(example_inputs), example_kwargs or {},
                                          captured.shape_range, captured.autocast),
                    range_proof=proof)


def shard_step(problem: Any, captured: Any, training: Training):
    """`remat.fx_passes.lowering.sharding.shard` of `problem` for `training`'s data parallelism."""
    from remat.fx_passes.lowering.sharding import shard

    return shard(problem, captured, data_parallel=training.data_parallel,
                 zero_stage=training.zero_stage, prefetch=training.prefetch,
                 backward_prefetch=training.backward_prefetch,
                 grad_bytes=training.grad_bytes,
                 reshard_after_forward=training.reshard_after_forward)


# ----------------------------------------------------------------------------- parameters


def _trainable(model: Any, training: Training):
    return [(n, p) for n, p in model.named_parameters() if not training.is_frozen(n, p)]


def _gradients_in_graph(model: Any, training: Training) -> bool:
    """Whether the gradients the optimizer reads are the graph's own outputs: the graph makes
    gradients in the parameters' dtype, so they are when that dtype has the configuration's
    gradient size (see remat.planner.job.accounting)."""
    trainable = _trainable(model, training)
    return all(p.element_size() == training.grad_bytes for _, p in trainable)


def _warn_on_mismatch(model: Any, training: Training) -> None:
    params = list(model.named_parameters())
    sizes = {p.element_size() for _, p in params}
    if params and sizes != {training.weight_bytes}:
        log.warning("the model's parameters have %s bytes per element but precision %r stores "
                    "weights in %d: the activations are planned in the model's dtype; cast the "
                    "model to plan what will run", sorted(sizes), training.precision.value,
                    training.weight_bytes)
    caching = cache_configs(model)
    if model.training and caching and "use_cache" in inspect.signature(model.forward).parameters:
        log.warning("%s returns its key/value cache (config.use_cache=True on %s): the plan "
                    "holds it to the end of the step, as eager would; set use_cache=False on "
                    "each of these configs for training (Hugging Face does under gradient "
                    "checkpointing)", type(model).__name__, ", ".join(caching))
    frozen_but_trained = [n for n, p in params
                          if p.requires_grad and training.is_frozen(n, None)]
    if frozen_but_trained:
        log.warning("%d parameters are frozen in Training but require grad in the model (%s...): "
                    "the graph computes their gradients; set requires_grad=False on them",
                    len(frozen_but_trained), frozen_but_trained[0])


def warn_eval_mode(model: Any, call: str) -> None:
    """A model in eval mode (``from_pretrained`` returns one) is planned as an evaluation step,
    which is seldom what a plan is made for: said before any work, with the remedy."""
    if getattr(model, "training", True):
        return
    log.warning("%s: %s is in eval mode (model.training is False; from_pretrained returns "
                "models in eval mode): dropout is off and BatchNorm uses its running "
                "statistics, and the plan is made for that mode; a training call in train "
                "mode then runs without the plan and its backward is refused. To plan the "
                "training step, call model.train() before %s", call, type(model).__name__, call)


def cache_configs(model: Any) -> list[str]:
    """The configs (by path: "model.config" for the root's) with use_cache=True whose model
    builds a key/value cache in its forward (`builds_cache`). A submodule may keep a config
    copy of its own: T5's decoder does, so ``model.config.use_cache = False`` does not reach
    it."""
    found, seen = [], set()
    for name, module in model.named_modules():
        config = getattr(module, "config", None)
        if config is None or id(config) in seen:
            continue
        seen.add(id(config))
        if getattr(config, "use_cache", False) is True and builds_cache(config, module):
            found.append(f"model.{name}.config" if name else "model.config")
    return found


def builds_cache(config: Any, module: Any) -> bool:
    """Whether `module`, which keeps `config` (use_cache=True), may build a key/value cache
    in its forward. Not when it is an encoder: transformers declares ``is_decoder`` on the
    configs of the models that are built as either (BERT, RoBERTa, ESM...), and their base
    model turns use_cache off unless the config says decoder (``BertModel.forward``:
    ``if self.config.is_decoder: ... else: use_cache = False``); the layers it built keep the
    flag (``BertLayer.is_decoder``). Everything else may: an encoder-decoder's config
    (``is_encoder_decoder``), a decoder's (``is_decoder=True``: T5's decoder stack), a config
    without the flag (Llama, GPT-2), and one whose model never set it on a layer (GPT-NeoX
    declares ``is_decoder=False`` and caches all the same)."""
    if getattr(config, "is_encoder_decoder", False) is True \
            or getattr(config, "is_decoder", None) is not False:
        return True
    flags = [m.is_decoder for m in module.modules()
             if isinstance(getattr(m, "is_decoder", None), bool)]
    return not flags or any(flags)


def _param_shapes(model: Any) -> dict[str, tuple[tuple[int, ...], str]]:
    return {n: (tuple(p.shape), str(p.dtype)) for n, p in model.named_parameters()}


def has_meta_weights(model: Any) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return any(p.device.type == "meta" or isinstance(p, FakeTensor)
               for p in model.parameters())


def device_of(model: Any) -> str:
    return str(next(iter(model.parameters())).device) if any(True for _ in
                                                            model.parameters()) else ""


def _as_tuple(inputs: Any) -> tuple:
    return tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)


def _input_specs(example_inputs: Sequence[Any]) -> tuple:
    import torch

    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    return tuple((tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else x
                 for x in example_inputs)


def check_same_parameters(model: Any, expected: dict) -> None:
    actual = _param_shapes(model)
    if actual != expected:
        missing = sorted(set(expected) - set(actual))
        extra = sorted(set(actual) - set(expected))
        differ = sorted(n for n in set(actual) & set(expected) if actual[n] != expected[n])
        raise RematError(
            "plan.apply(model): the model's parameters differ from the planned model's "
            f"(missing {missing[:3]}, unexpected {extra[:3]}, other shape or dtype "
            f"{differ[:3]}); plan this model with remat.optimize")


def check_eager_device(model: Any, captured_device: str) -> None:
    import torch

    params = list(model.parameters())
    where = params[0].device.type if params else "cpu"
    if where != torch.device(captured_device).type:
        raise RematError(
            f"plan.apply(model): the eager plan was made on {captured_device} and the model is "
            f"on {where}; eager PyTorch runs other ops on other devices (dropout, attention), "
            "so plan on the device you train on")
