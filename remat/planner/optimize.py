"""`optimize(model, budget=...)`: capture -> profile -> lower -> solve -> simulate -> rewrite.

Each step is its own function of the fx_passes and solvers packages; this module only composes
them, in two halves that `sweep` reuses: `prepare` (capture, profile, lower, the state; once
per model and batch) and `plan_prepared` (solve, simulate, report; once per budget).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Callable, Sequence

from remat.errors import BudgetError, RematError
from remat.planner import accounting
from remat.planner.accounting import StepMemory
from remat.planner.budget import format_size, parse_size
from remat.planner.report import (Measured, MemoryColumn, Report, SolverSummary, kept_tensors,
                                  module_rows, price)
from remat.planner.training import StateMemory, Training, state_memory
from remat.solvers import Problem, Schedule, SolverOptions, Strategy, solve
from remat.solvers.schedule import drop_unneeded, make_schedule, recomputable

log = logging.getLogger(__name__)

# The baselines the report sets beside the plan.
BASELINES = (Strategy.SAVE_ALL, Strategy.CHECKPOINT_BLOCKS)


@dataclass(frozen=True)
class Prepared:
    """A model's training step, captured, profiled and lowered, with its state: everything that
    does not depend on the budget."""

    problem: Problem
    captured: Any  # remat.fx_passes.capture.Captured
    profile: Any  # remat.fx_passes.profile.Profile
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
    prepare_time: float = 0.0

    @cached_property
    def baselines(self) -> dict[Strategy, Schedule]:
        """The baselines' schedules, whatever their peak (the report shows whether they fit)."""
        unbounded = sum(op.size + op.temp for op in self.problem.ops)
        return {s: solve(self.problem, unbounded, s) for s in BASELINES}

    def step_memory(self, schedule: Schedule, budget: int | None) -> StepMemory:
        return accounting.step_memory(self.problem, schedule, self.state, self.training,
                                      gradients_in_graph=self.gradients_in_graph, budget=budget)

    def allowance(self, budget: int) -> int:
        return accounting.activation_allowance(budget, self.state, self.training,
                                               gradients_in_graph=self.gradients_in_graph)


class Plan:
    """The answer of `optimize`: a schedule for one model, batch shape, training configuration
    and budget, what it holds and costs, and the module that runs it."""

    def __init__(self, *, model: Any, prepared: Prepared, schedule: Schedule,
                 memory: StepMemory, target: str, solver: Strategy,
                 solver_options: SolverOptions | None, activation_budget: int | None):
        self._model = model
        self.solver = solver
        self.activation_budget = activation_budget
        self.prepared = prepared
        self.schedule = schedule
        self.memory = memory
        self.target = target
        self.solver_options = solver_options

    # -- the numbers
    @property
    def problem(self) -> Problem:
        return self.prepared.problem

    @property
    def training(self) -> Training:
        return self.prepared.training

    @property
    def peak(self) -> int:
        """Bytes of the whole step under the plan, per rank: the state, the simulated activation
        peak, the reserve and the fragmentation margin (what the budget is compared with)."""
        return self.memory.total

    @property
    def activation_peak(self) -> int:
        return self.schedule.peak

    @property
    def recompute_flops(self) -> int:
        return self.schedule.recompute_flops

    @property
    def status(self):
        return self.schedule.status

    @property
    def gap(self) -> float | None:
        return self.schedule.gap

    # -- running it
    @cached_property
    def module(self):
        """The planned training step of the model handed to `optimize`: an nn.Module whose
        forward returns the loss and whose backward runs the plan; it shares the model's
        parameters."""
        if self.prepared.meta_weights:
            raise RematError(
                "the plan was made on a model without weights (meta or fake parameters), so it "
                "cannot run; build the model with real weights and call plan.apply(model)")
        return self.apply(self._model)

    def apply(self, model: Any):
        """The planned training step of `model`, which must have the parameters (names,
        shapes, dtypes) of the model the plan was made for, with real weights."""
        from remat.fx_passes.planned import planned_module

        _check_same_parameters(model, self.prepared.param_shapes)
        if _has_meta_weights(model):
            raise RematError("plan.apply(model) needs real weights; this model's parameters are "
                             "meta or fake tensors: load or initialize the weights first")
        plan = self
        where = _device_of(model)
        if where != self.prepared.captured.device:
            plan = self._replan(model, where)
        return planned_module(model, plan.problem, plan.schedule, loss_fn=self.prepared.loss_fn)

    def _replan(self, model: Any, where: str) -> "Plan":
        """The same plan made on the graph `model`'s device produces: PyTorch picks kernels by
        device (attention on a CPU is another op than on meta), so the schedule of one graph
        cannot run on the other."""
        import torch

        inputs = tuple(torch.zeros(spec[0], dtype=spec[1], device=where)
                       if isinstance(spec, tuple) and len(spec) == 2
                       and isinstance(spec[1], torch.dtype) else spec
                       for spec in self.prepared.inputs)
        prepared = prepare(model, inputs, training=self.training, target=self.target,
                           loss_fn=self.prepared.loss_fn)
        plan = plan_prepared(model, prepared, budget=self.memory.budget,
                             activation_budget=self.activation_budget, target=self.target,
                             solver=self.solver, solver_options=self.solver_options)
        log.warning("the plan was made on %s tensors and is applied on %s, where the step's "
                    "graph differs: planned again on it (activation peak %s, was %s)",
                    self.prepared.captured.device, where, format_size(plan.activation_peak),
                    format_size(self.activation_peak))
        return plan

    # -- saying it
    def report(self, *, measured: Measured | None = None) -> Report:
        from remat.fx_passes.devices import device

        prepared = self.prepared
        chip = device(self.target)
        columns = [MemoryColumn("plan", self.memory)]
        for strategy, schedule in prepared.baselines.items():
            columns.append(MemoryColumn(strategy.value.replace("_", " "),
                                        prepared.step_memory(schedule, self.memory.budget)))
        notes = [f"the step time is the sum of the ops' times: "
                 f"{'measured per op' if prepared.profile.measured else 'a roofline'} for "
                 f"{chip.name}, a lower bound on the real step"]
        notes.append("FLOPs are torch.utils.flop_counter's: matmuls and attention only; "
                     "recomputed pointwise ops and norms cost time but count 0 FLOPs")
        if self.memory.budget is None:
            notes.append("only the activations were bounded (activation_budget=); the totals "
                         "add the configured state")
        captured = prepared.captured
        title = (f"remat plan for {captured.model_name}: {prepared.state.parameters:,} "
                 f"parameters, inputs {captured.input_shapes}, {self.training.precision.value} "
                 f"{self.training.optimizer.value}, target {chip.name}")
        return Report(
            title=title, memory=tuple(columns),
            modules=module_rows(self.problem, self.schedule),
            kept=kept_tensors(self.problem, self.schedule),
            price=price(self.problem, self.schedule, device=chip.name,
                        peak_flops=chip.peak_flops(self.training.compute_dtype),
                        time_source="measured" if prepared.profile.measured else "predicted"),
            solver=SolverSummary.of(self.schedule), measured=measured, notes=tuple(notes))

    def to_dict(self) -> dict:
        return {"training": self.training.to_dict(), "target": self.target, "peak": self.peak,
                "memory": self.memory.to_dict(),
                "schedule": self.schedule.to_dict(self.problem),
                "report": self.report().to_dict()}

    def __repr__(self) -> str:
        budget = "" if self.memory.budget is None else f" of {format_size(self.memory.budget)}"
        return (f"<Plan {self.schedule.strategy} {self.status.value}: peak "
                f"{format_size(self.peak)}{budget}, recompute {self.recompute_flops:.3g} FLOPs>")


def optimize(model: Any, budget: int | str | None = None, *,
             activation_budget: int | str | None = None, example_inputs: Sequence[Any],
             training: Training = Training(), target: str = "h100",
             solver: Strategy | str = Strategy.OPTIMAL,
             solver_options: SolverOptions | None = None,
             loss_fn: Callable | None = None, execution: str = "compiled",
             blocks: Sequence[str] | None = None) -> Plan:
    """The plan of least recompute time (least FLOPs with ``SolverOptions(objective="flops")``)
    whose whole training step fits `budget` ("60GB",
    "60GiB", an int of bytes), or whose activations alone fit `activation_budget`; exactly one
    of the two. `example_inputs` is one micro-batch; `target` the device whose speed the cost
    model uses; `solver` a `Strategy` (the exact CP-SAT solver by default). Raises BudgetError
    (the smallest budget that fits, the dominant term and its remedy) when nothing fits.

    `execution="eager"` plans for per-block selective checkpointing in an eager loop
    (FSDP2, DDP): `model = plan.apply(model)` wraps the blocks (the repeated children, or the
    modules named in `blocks`) in place; see `remat.planner.eager_plan`."""
    if execution not in ("compiled", "eager"):
        raise ValueError(f"execution must be \"compiled\" or \"eager\", not {execution!r}")
    if blocks is not None and execution != "eager":
        raise ValueError("blocks= names the modules to checkpoint in execution=\"eager\"")
    whole, activations = _one_budget(budget, activation_budget)
    prepared = prepare(model, example_inputs, training=training, target=target, loss_fn=loss_fn)
    if execution == "eager":
        from remat.planner.eager_plan import plan_eager_mode

        return plan_eager_mode(model, prepared, budget=whole, activation_budget=activations,
                               target=target, solver=solver, solver_options=solver_options,
                               blocks=blocks, example_inputs=example_inputs)
    return plan_prepared(model, prepared, budget=whole, activation_budget=activations,
                         target=target, solver=solver, solver_options=solver_options)


def _one_budget(budget, activation_budget) -> tuple[int | None, int | None]:
    if (budget is None) == (activation_budget is None):
        raise ValueError("give exactly one of budget= (the whole step, e.g. \"60GB\") and "
                         "activation_budget= (the activations alone)")
    if budget is not None:
        return parse_size(budget), None
    return None, parse_size(activation_budget, allow_zero=True)


def prepare(model: Any, example_inputs: Sequence[Any], *, training: Training = Training(),
            target: str = "h100", loss_fn: Callable | None = None) -> Prepared:
    """Capture, profile and lower the step once; compute the state it holds."""
    from remat.fx_passes.capture import capture
    from remat.fx_passes.lower import lower
    from remat.fx_passes.profile import profile

    start = time.perf_counter()
    log.info("capturing the training step of %s", type(model).__name__)
    captured = capture(model, example_inputs, loss_fn=loss_fn)
    log.info("profiling %d nodes for %s", len(captured.graph.nodes), target)
    profiled = profile(captured, target=target)
    problem = lower(captured)
    log.info("lowered to %d ops (%d forward), %d candidates", len(problem),
             problem.num_forward, len(problem.candidates))
    state = state_memory(model, training)
    _warn_on_mismatch(model, training)
    return Prepared(problem=problem, captured=captured, profile=profiled, state=state,
                    training=training, gradients_in_graph=_gradients_in_graph(model, training),
                    param_shapes=_param_shapes(model), loss_fn=loss_fn,
                    meta_weights=_has_meta_weights(model), inputs=_input_specs(example_inputs),
                    prepare_time=time.perf_counter() - start)


def plan_prepared(model: Any, prepared: Prepared, *, budget: int | None,
                  activation_budget: int | None, target: str,
                  solver: Strategy | str = Strategy.OPTIMAL,
                  solver_options: SolverOptions | None = None) -> Plan:
    """Solve one budget for a prepared step and simulate the result."""
    strategy = Strategy(solver)
    allowance = activation_budget if budget is None else prepared.allowance(budget)
    log.info("solving with %s for an activation allowance of %s", strategy.value,
             format_size(allowance))
    try:
        if allowance < 0:
            # The state alone overflows; solving at zero still finds the smallest peak.
            solve(prepared.problem, 0, strategy, solver_options)
            raise AssertionError("a schedule with no activations at all")  # pragma: no cover
        schedule = solve(prepared.problem, allowance, strategy, solver_options)
    except BudgetError as e:
        raise _budget_error(prepared, e, budget=budget, strategy=strategy) from None
    memory = prepared.step_memory(schedule, budget)
    log.info("plan: %s %s, activation peak %s, step %s", schedule.strategy,
             schedule.status.value, format_size(schedule.peak), format_size(memory.total))
    return Plan(model=model, prepared=prepared, schedule=schedule, memory=memory, target=target,
                solver=strategy, solver_options=solver_options,
                activation_budget=activation_budget)


def _budget_error(prepared: Prepared, error: BudgetError, *, budget: int | None,
                  strategy: Strategy) -> BudgetError:
    if budget is None:  # activation_budget: the activations are all there is to say about
        remedy = accounting.REMEDIES["activations"]
        return BudgetError(f"{error}\n  remedy: {remedy}", budget=error.budget,
                           smallest=error.smallest, dominant="activations", remedy=remedy,
                           schedule=error.schedule)
    # The graph's gradients inside the smallest peak belong to the gradients term: estimate
    # them on the schedule that recomputes all it may, the nearest to the smallest peak.
    problem = prepared.problem
    most = make_schedule(problem, drop_unneeded(problem, recomputable(problem)))
    _, grads = accounting.gradients_at_peak(problem, most)
    whole = accounting.budget_error(
        budget, smallest_activations=error.smallest, state=prepared.state,
        training=prepared.training, gradients_in_graph=prepared.gradients_in_graph,
        gradients_in_peak=min(grads, error.smallest or 0), strategy=strategy.value)
    whole.schedule = error.schedule
    return whole


# ----------------------------------------------------------------------------- parameters


def _trainable(model: Any, training: Training):
    return [(n, p) for n, p in model.named_parameters() if not training.is_frozen(n, p)]


def _gradients_in_graph(model: Any, training: Training) -> bool:
    """Whether the gradients the optimizer reads are the graph's own outputs: the graph makes
    gradients in the parameters' dtype, so they are when that dtype has the configuration's
    gradient size (see remat.planner.accounting)."""
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
    frozen_but_trained = [n for n, p in params
                          if p.requires_grad and training.is_frozen(n, None)]
    if frozen_but_trained:
        log.warning("%d parameters are frozen in Training but require grad in the model (%s...): "
                    "the graph computes their gradients; set requires_grad=False on them",
                    len(frozen_but_trained), frozen_but_trained[0])


def _param_shapes(model: Any) -> dict[str, tuple[tuple[int, ...], str]]:
    return {n: (tuple(p.shape), str(p.dtype)) for n, p in model.named_parameters()}


def _has_meta_weights(model: Any) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return any(p.device.type == "meta" or isinstance(p, FakeTensor)
               for p in model.parameters())


def _device_of(model: Any) -> str:
    return str(next(iter(model.parameters())).device) if any(True for _ in
                                                            model.parameters()) else ""


def _input_specs(example_inputs: Sequence[Any]) -> tuple:
    import torch

    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    return tuple((tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else x
                 for x in example_inputs)


def _check_same_parameters(model: Any, expected: dict) -> None:
    actual = _param_shapes(model)
    if actual != expected:
        missing = sorted(set(expected) - set(actual))
        extra = sorted(set(actual) - set(expected))
        differ = sorted(n for n in set(actual) & set(expected) if actual[n] != expected[n])
        raise RematError(
            "plan.apply(model): the model's parameters differ from the planned model's "
            f"(missing {missing[:3]}, unexpected {extra[:3]}, other shape or dtype "
            f"{differ[:3]}); plan this model with remat.optimize")
