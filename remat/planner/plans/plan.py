"""`Plan`, the answer of `optimize`: a schedule for one model, batch shape, training
configuration and budget, what it holds and costs, the module that runs it and its report; and
`plan_prepared`, which solves one budget for a prepared step (`optimize` and `sweep` both
end here). `remat.planner.plans.eager_plan.EagerPlan` is the eager mode's kind of plan."""
from __future__ import annotations

import logging
import time
from functools import cached_property
from typing import Any

from remat.errors import BudgetError, RematError
from remat.planner.job import accounting
from remat.planner.job.accounting import StepMemory
from remat.planner.job.budget import format_size
from remat.planner.plans.offload_report import offload_rows
from remat.planner.plans.gap_advice import warn_on_gap
from remat.planner.plans.report import (Measured, MemoryColumn, Report, kept_tensors,
                                  module_rows, price)
from remat.planner.plans.solver_report import SolverSummary, phases_of, with_phases
from remat.planner.plans.prepare import (Prepared, check_same_parameters, device_of,
                                   has_meta_weights, prepare)
from remat.planner.job.ranks import options_for_this_job
from remat.fx_passes.tracing.unbacked import worst_case_lines
from remat.planner.job.training import Training
from remat.solvers import Problem, Schedule, SolverOptions, Strategy, solve
from remat.solvers.entry import LIMITED, STRATEGIES

log = logging.getLogger(__name__)

__all__ = ["Plan", "plan_prepared", "budget_error_in_user_terms", "state_overflow"]


class Plan:
    """The answer of `optimize`: a schedule for one model, batch shape, training configuration
    and budget, what it holds and costs, and the module that runs it."""

    execution = "compiled"  # how the plan runs: the whole step as one rewritten graph
    compile = False
    """Whether `module` runs the step through Inductor (``optimize(..., compile=True)``)
    rather than op by op; for an eager plan, whether its peak was read under torch.compile of
    the applied model (True) or of each block ("blocks")."""
    inductor = None
    """`remat.planner.plans.inductor_check.InductorCheck`: the allocator's readings of the step
    under Inductor that the plan was accepted on (compile=True), else None."""

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
        self.shapes = None
        """remat.planner.plans.shapes.RangePlans for a plan made for a range of shapes
        (dynamic=)."""

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
        """The step's peak less the state (parameters, gradients, master, optimizer state)."""
        return self.memory.activation_peak

    @property
    def recompute_flops(self) -> int:
        return self.schedule.recompute_flops

    @property
    def status(self):
        return self.schedule.status

    @property
    def gap(self) -> float | None:
        return self.schedule.gap

    @property
    def phases(self) -> tuple[tuple[str, float], ...]:
        """(phase, wall seconds) of the call that made the plan: the preparation's (capture,
        profile, lower; `Prepared.phases`), the eager probe's, the solve's; kept in the
        schedule's info, so a plan file carries them (`with_phases`)."""
        return phases_of(self.schedule)

    @property
    def training_mode(self) -> str:
        """"train" or "eval": the mode the model was in when planned. Dropout and BatchNorm
        make other graphs in the other mode: there the planned module runs the model itself, and
        refuses a backward through its output."""
        return "train" if self.prepared.captured.training else "eval"

    # -- running it
    @cached_property
    def module(self):
        """The planned training step of the model handed to `optimize`: an nn.Module sharing
        the model's parameters, called as the model is (``plan.module(*args, **kwargs)``). It
        returns what the model returns: a loss tensor as is; a ``ModelOutput``, dict or tuple
        with the loss in its place and its other tensors (logits...) detached, since the
        plan's backward starts from the loss alone (``optimize(..., returns="loss")`` returns
        the loss tensor instead; with ``loss_fn=`` the module returns loss_fn's loss).
        ``out.loss.backward()`` runs the planned backward."""
        if self.prepared.meta_weights:
            raise RematError(
                "the plan was made on a model without weights (meta or fake parameters), so it "
                "cannot run; build the model with real weights and call plan.apply(model)")
        return self.apply(self._model)

    def apply(self, model: Any):
        """The planned training step of `model`, which must have the parameters (names,
        shapes, dtypes) of the model the plan was made for, with real weights."""
        from remat.fx_passes.compiled.planned import planned_module
        from remat.fx_passes.tracing.replicate import ReplicatedCapture

        check_same_parameters(model, self.prepared.param_shapes)
        if has_meta_weights(model):
            raise RematError("plan.apply(model) needs real weights; this model's parameters are "
                             "meta or fake tensors: load or initialize the weights first")
        plan = self
        where = device_of(model)
        # A replicated capture's graph stands for the whole model but was traced on three
        # blocks: what runs is planned again on the full graph.
        if where != self.prepared.captured.device \
                or isinstance(self.prepared.captured, ReplicatedCapture):
            plan = self._replan(model, where)
        from remat.fx_passes.lowering.sharding import project

        sharded = plan.prepared.sharded
        buckets = None if self.shapes is None else {
            bucket: (p.prepared.sharded.graph, project(p.prepared.sharded, p.schedule))
            for bucket, p in self.shapes.plans.items()}
        return planned_module(model, sharded.graph, project(sharded, plan.schedule),
                              compile=self.compile,
                              loss_fn=self.prepared.loss_fn, returns=self.prepared.returns,
                              training=self.prepared.captured.training,
                              call_spec=plan.prepared.call_spec, buckets=buckets)

    def _replan(self, model: Any, where: str) -> "Plan":
        """The same plan made on the graph `model`'s device produces: PyTorch picks kernels by
        device (attention on a CPU is another op than on meta), so the schedule of one graph
        cannot run on the other."""
        import torch

        if self.shapes is not None:
            raise RematError(f"the plan for a range of shapes was made on "
                             f"{self.prepared.captured.device} tensors and the model is on "
                             f"{where}: plan it on the device it trains on")

        def make(spec):
            if isinstance(spec, tuple) and len(spec) == 2 and isinstance(spec[1], torch.dtype):
                return torch.zeros(spec[0], dtype=spec[1], device=where)
            return spec

        prepared = prepare(model, tuple(make(s) for s in self.prepared.inputs),
                           example_kwargs={k: make(s) for k, s in self.prepared.kwargs.items()},
                           training=self.training, target=self.target,
                           loss_fn=self.prepared.loss_fn, returns=self.prepared.returns,
                           inductor=self.prepared.captured.inductor)
        plan = plan_prepared(model, prepared, budget=self.memory.budget,
                             activation_budget=self.activation_budget, target=self.target,
                             solver=self.solver,
                             solver_options=self.solver_options)
        log.warning("the plan was made on %s (%s tensors) and is applied on %s tensors, where "
                    "the step's graph differs: planned again on the full graph (activation "
                    "peak %s, was %s)", "a replicated capture" if type(self.prepared.captured)
                    .__name__ == "ReplicatedCapture" else "the traced graph",
                    self.prepared.captured.device, where, format_size(plan.activation_peak),
                    format_size(self.activation_peak))
        return plan

    # -- saying it
    def report(self, *, measured: Measured | None = None) -> Report:
        from remat.fx_passes.measuring.devices import device

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
        if self.shapes is not None:
            notes.extend(self.shapes.notes())
        if self.inductor is not None:
            notes.append(self.inductor.note())
        captured = prepared.captured
        notes.extend(worst_case_notes(captured, self.problem))
        title = (f"remat plan for {captured.model_name} in {self.training_mode} mode: "
                 f"{prepared.state.parameters:,} parameters, inputs {captured.input_shapes}, "
                 f"{self.training.precision.value} {self.training.optimizer.value}, "
                 f"target {chip.name}"
                 + ("" if prepared.profile.measured else " (times predicted for it by a "
                    "roofline, not measured on this machine)"))
        return Report(
            title=title, memory=tuple(columns),
            modules=module_rows(self.problem, self.schedule),
            kept=kept_tensors(self.problem, self.schedule),
            price=price(self.problem, self.schedule, device=chip.name,
                        peak_flops=chip.peak_flops(self.training.compute_dtype),
                        time_source="measured" if prepared.profile.measured else "predicted"),
            solver=SolverSummary.of(self.schedule), measured=measured, notes=tuple(notes),
            offloaded=offload_rows(*self.offload_timeline()) if self.schedule.offload_at else ())

    def offload_timeline(self):
        """(problem, `remat.solvers.timeline.overlap.Transfers`) of the plan's offloads."""
        from remat.solvers.timeline.overlap import transfers
        from remat.solvers.timeline.simulate import step_order

        return self.problem, transfers(self.problem, self.schedule,
                                       step_order(self.problem, self.schedule))

    def to_dict(self) -> dict:
        return {"training": self.training.to_dict(), "target": self.target, "peak": self.peak,
                "mode": self.training_mode,
                "memory": self.memory.to_dict(),
                "schedule": self.schedule.to_dict(self.problem),
                "report": self.report().to_dict(),
                **({} if self.shapes is None else {"shapes": self.shapes.to_dict()})}

    def save(self, path) -> None:
        """Write the plan to `path` as a JSON plan file (`remat.planner.plans.plan_file`), which
        ``remat.load_plan(path, model)`` makes a plan again on the model, without solving."""
        from remat.planner.plans.plan_file import save

        if self.shapes is not None:
            raise RematError("plan.save: a plan file holds a plan for fixed shapes; a plan for "
                             f"a range of shapes ({self.shapes.shape_range}) is made by "
                             "remat.optimize(..., dynamic=...) on each run")
        save(self, path)

    def __reduce_ex__(self, protocol):
        # The plan holds the model and its captured graph (fake tensors, fx code), which
        # pickle cannot carry; a file holds what makes the plan again on a model.
        raise TypeError("a remat Plan cannot be pickled: it holds its model and the captured "
                        "graph. Save it with plan.save(path) and load it onto the model with "
                        "remat.load_plan(path, model), or send it to other ranks with "
                        "remat.broadcast_plan; plan.schedule pickles")

    def __repr__(self) -> str:
        budget = "" if self.memory.budget is None else f" of {format_size(self.memory.budget)}"
        return (f"<Plan {self.schedule.strategy} {self.status.value}: peak "
                f"{format_size(self.peak)}{budget}, recompute {self.recompute_flops:.3g} FLOPs>")


def plan_prepared(model: Any, prepared: Prepared, *, budget: int | None,
                  activation_budget: int | None, target: str,
                  solver: Strategy | str = Strategy.OPTIMAL,
                  solver_options: SolverOptions | None = None, allowance_cut: int = 0) -> Plan:
    """Solve one budget for a prepared step and simulate the result. `allowance_cut`: bytes
    kept free below the budget's allowance (what Inductor was measured to add to a plan)."""
    from remat.planner.job.tensor_layout import tensor_layout

    if tensor_layout(model).parallel:
        raise RematError(
            "a compiled plan of a tensor-parallel (DTensor) model is not supported: plan it "
            "for eager training, remat.optimize(model, ..., execution=\"eager\") (or "
            "remat.planner.parallel.tensor_parallel.plan_tensor_parallel), and apply the plan to the "
            "parallelized model with plan.apply(model)")
    strategy = Strategy(solver)
    solver_options = options_for_this_job(solver_options)
    allowance = prepared.allowance(budget, activation_budget) - allowance_cut
    log.info("solving with %s for an activation allowance of %s", strategy.value,
             format_size(allowance))
    if allowance < 0:  # known before any solve, whatever its time limit
        raise state_overflow(prepared, budget, strategy, solver_options)
    solving = time.perf_counter()
    try:
        schedule = solve(prepared.problem, allowance, strategy, solver_options)
    except BudgetError as e:
        raise budget_error_in_user_terms(prepared, e, budget=budget, strategy=strategy) from None
    schedule = with_phases(schedule, (*prepared.phases,
                                      ("solve", time.perf_counter() - solving)))
    warn_on_gap(schedule, log)
    memory = prepared.step_memory(schedule, budget)
    log.info("plan: %s %s, activation peak %s, step %s", schedule.strategy,
             schedule.status.value, format_size(memory.activation_peak), format_size(memory.total))
    return Plan(model=model, prepared=prepared, schedule=schedule, memory=memory, target=target,
                solver=strategy, solver_options=solver_options,
                activation_budget=activation_budget)


def state_overflow(prepared: Prepared, budget: int, strategy: Strategy,
                   options: SolverOptions | None, per_block: Schedule | None = None
                   ) -> BudgetError:
    """The BudgetError of a whole-step `budget` that the state alone (with the reserve and the
    margin) exceeds: its terms and the remedy of the largest, raised before any solve. The
    smallest budget named is a time-limited strategy's per-block checkpointing plan
    (`per_block`, the eager mode's; else the compiled mode's), found and not proven the least;
    a baseline's is its own plan's at budget 0 (no time limit: exact)."""
    if per_block is None and STRATEGIES[strategy] not in LIMITED:
        try:
            peak = solve(prepared.problem, 0, strategy, options).peak
        except BudgetError as e:
            peak = e.smallest
        error = BudgetError("the state alone exceeds the budget", budget=0, smallest=peak)
        return budget_error_in_user_terms(prepared, error, budget=budget, strategy=strategy)
    if per_block is None:
        per_block = prepared.baselines[Strategy.CHECKPOINT_BLOCKS]
    whole = accounting.budget_error(
        budget, smallest_activations=max(0, per_block.peak - prepared.graph_gradients),
        state=prepared.state, training=prepared.training, strategy="checkpointing every block",
        proof=f"found by checkpointing every block, not proven the least: {strategy.value} "
              "runs only once the budget holds the state", proven=False)
    whole.schedule = per_block
    return whole


def budget_error_in_user_terms(prepared: Prepared, error: BudgetError, *, budget: int | None,
                  strategy: Strategy) -> BudgetError:
    """The solver's BudgetError (in simulated-peak terms) restated in the user's terms: the
    activations are the step's peak less the state (remat.planner.job.accounting); its
    smallest labelled proven, or found (`BudgetError.proven`)."""
    grads = prepared.graph_gradients
    smallest = None if error.smallest is None else max(0, error.smallest - grads)
    proof = {True: "proven: no plan fits a smaller one",
             False: "found within the time limit, not proven the least: a longer time_limit "
                    "may find a smaller one"}.get(error.proven, "")
    if budget is None:  # activation_budget: the activations are all there is to say about
        remedy = accounting.REMEDIES["activations"]
        asked = error.budget - grads if error.budget is not None else None
        lines = [f"no plan keeps the activations within {format_size(asked)} ({asked:,} bytes)"]
        if smallest is not None:
            lines.append(f"  the smallest activation peak ({strategy.value}): "
                         f"{format_size(smallest)} ({smallest:,} bytes), the step's peak less "
                         "the state" + (f"; {proof}" if proof else ""))
        lines += [f"  the solver: {error} (its figures count the graph's "
                  f"{format_size(grads)} of gradients too)", f"  remedy: {remedy}"]
        return BudgetError("\n".join(lines), budget=asked, smallest=smallest,
                           dominant="activations", remedy=remedy, schedule=error.schedule,
                           proven=error.proven)
    whole = accounting.budget_error(budget, smallest_activations=smallest, state=prepared.state,
                                    training=prepared.training, strategy=strategy.value,
                                    proof=proof, proven=error.proven)
    whole.schedule = error.schedule
    return whole




def worst_case_notes(captured: Any, problem: Problem) -> list[str]:
    """The report's note on the tensors whose sizes depend on the data: how many, counted at
    what worst case (`remat.fx_passes.tracing.unbacked`); none for a graph without them."""
    graph = getattr(captured, "graph_module", None)
    cases = graph.meta.get("remat_worst_case", []) if graph is not None else []
    owners = {op.name for op in problem.ops if op.size or op.temp}
    lines = worst_case_lines(cases, owners=owners)
    if not lines:
        return []
    return ["\n  ".join([lines[0] + " (the bound, not the example's routing: the plan holds "
                          "for every step)", *(line.strip() for line in lines[1:])])]
