"""The strategies `peers.py` compares, each as a way to build one training step of a model.

Eager strategies (no checkpointing, torch.utils.checkpoint per block, Chen's sqrt(n) segments)
change the model's blocks for the duration of a `with`; compiled ones (PyTorch's
activation_memory_budget, remat's plan) return a step whose graphs `measure` instruments.
"""
from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from _peers_measure import Measured, Probe, inside_planned, measure


@dataclass
class Case:
    """One model ready to benchmark."""

    name: str
    model: nn.Module
    inputs: tuple
    blocks: list[nn.Module]  # the repeated blocks, in forward order
    chain: bool  # each block's output is the next block's first input, other arguments shared
    hf: nn.Module | None = None  # the transformers model inside, if any
    seed: int = 0

    def __post_init__(self) -> None:
        self._buffers = [b.detach().clone() for b in self.model.buffers()]

    def reset(self) -> None:
        """Buffers back to their first values (BatchNorm statistics move at every step)."""
        with torch.no_grad():
            for b, saved in zip(self.model.buffers(), self._buffers):
                b.copy_(saved)

    def loss(self, *inputs) -> torch.Tensor:
        from remat.fx_passes.tracing.capture import default_loss

        return default_loss(self.model(*inputs))

    def measure(self, step: Callable, inside=None, repeats: int = 2) -> Measured:
        return measure(step, self.inputs, self.model, seed=self.seed, reset=self.reset,
                       inside=inside, repeats=repeats)


# ---- eager strategies ------------------------------------------------------------------------

@contextlib.contextmanager
def _forwards(blocks: list[nn.Module], new: list[Callable | None]) -> Iterator[None]:
    """Give blocks another forward for a while (an instance attribute shadows the class's; module
    names, parameters and hooks stay as they are)."""
    for block, fn in zip(blocks, new):
        if fn is not None:
            block.forward = fn
    try:
        yield
    finally:
        for block, fn in zip(blocks, new):
            if fn is not None:
                del block.forward


def _checkpointed(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def forward(*args, **kwargs):
        return checkpoint(fn, *args, use_reentrant=False, **kwargs)
    return forward


@contextlib.contextmanager
def per_block(case: Case) -> Iterator[str]:
    """torch.utils.checkpoint around every block: transformers' own switch for its models."""
    if case.hf is not None:
        kwargs = {"use_reentrant": False}
        if hasattr(case.hf, "activation_checkpointing_enable"):
            case.hf.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
            off = case.hf.activation_checkpointing_disable
        else:  # transformers < 5.2x
            case.hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
            off = case.hf.gradient_checkpointing_disable
        try:
            yield "transformers activation_checkpointing_enable(use_reentrant=False)"
        finally:
            off()
        return
    with _forwards(case.blocks, [_checkpointed(b.forward) for b in case.blocks]):
        yield "torch.utils.checkpoint(use_reentrant=False) per block"


def chen_segments(n: int) -> list[range]:
    """round(sqrt(n)) segments of consecutive blocks, as equal in count as they come."""
    k = max(1, round(math.sqrt(n)))
    bounds = [round(i * n / k) for i in range(k + 1)]
    return [range(bounds[i], bounds[i + 1]) for i in range(k)]


def _segment(forwards: list[Callable]) -> Callable:
    def run(x, *args, **kwargs):
        for fn in forwards:
            x = fn(x, *args, **kwargs)
        return x
    return run


def _passthrough(x, *args, **kwargs):
    return x


@contextlib.contextmanager
def chen_sqrt(case: Case) -> Iterator[str]:
    """checkpoint_sequential over the blocks: the first block of each segment runs the whole
    segment under one checkpoint and the others pass their input through. Like
    checkpoint_sequential, the last segment is not checkpointed: its backward comes at once."""
    if not case.chain:
        raise NotImplementedError("the blocks are not a chain (skip connections cross them)")
    segments = chen_segments(len(case.blocks))
    new: list[Callable | None] = [None] * len(case.blocks)
    for s, seg in enumerate(segments):
        run = _segment([case.blocks[i].forward for i in seg])
        new[seg[0]] = run if s == len(segments) - 1 else _checkpointed(run)
        for i in seg[1:]:
            new[i] = _passthrough
    with _forwards(case.blocks, new):
        yield (f"checkpoint_sequential-style, {len(segments)} segments of "
               f"{'/'.join(str(len(s)) for s in segments)} blocks, last not checkpointed")


EAGER = {"per_block": per_block, "chen_sqrt": chen_sqrt}


def eager(case: Case, strategy: str, repeats: int) -> tuple[Measured, str]:
    if strategy == "none":
        return case.measure(case.loss, repeats=repeats), "plain eager PyTorch"
    with EAGER[strategy](case) as how:
        return case.measure(case.loss, repeats=repeats), how


# ---- compiled strategies ---------------------------------------------------------------------

def torch_budget(case: Case, fraction: float, repeats: int) -> Measured:
    """AOTAutograd with the min-cut partitioner that torch.compile uses, under
    activation_memory_budget = fraction; graphs run op by op (boxed_nop), as in remat's measured
    step."""
    from torch._functorch import config as functorch_config
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    from remat.fx_passes.tracing.capture import compile_step

    if not hasattr(functorch_config, "activation_memory_budget"):
        raise NotImplementedError(f"torch {torch.__version__} has no activation_memory_budget")
    probe = Probe()
    step = compile_step(case.model, min_cut_rematerialization_partition,
                        fw_compiler=probe.compiler("forward"),
                        bw_compiler=probe.compiler("backward"))
    try:
        # The fraction is read when the joint graph is partitioned, at the first call.
        with functorch_config.patch(activation_memory_budget=fraction):
            return case.measure(step, inside=probe.inside, repeats=repeats)
    finally:
        torch._dynamo.reset()


@dataclass
class RematRun:
    measured: Measured
    predicted: int  # the plan's simulated peak: its activations and the gradients
    status: str  # OPTIMAL, FEASIBLE (time limit, with a gap) or HEURISTIC
    gap: float | None


class Remat:
    """remat.optimize(model, activation_budget=...) for many budgets: the two halves it composes
    (`prepare`: capture, profile, lower; `plan_prepared`: solve, simulate) so the capture runs
    once per model, as in remat.sweep.

    Budgets and peaks here are in the benchmark's terms: the allocator's peak of the step, the
    parameters' gradients included (the allocator sees them made in the backward, and
    every baseline's measured peak counts them). remat's `activation_budget` and
    `plan.activation_peak` leave those gradients out (they are state), so a budget is given to
    remat less `gradients`, and its figures are read back with them added."""

    def __init__(self, case: Case, *, time_limit: float):
        from remat.planner.plans.prepare import prepare
        from remat.solvers import SolverOptions

        self.case = case
        self.prepared = prepare(case.model, case.inputs)
        # The benchmark's measure is recompute FLOPs, so remat minimizes FLOPs here; its default
        # objective, recompute time on the target, would trade FLOPs for fewer slow pointwise
        # ops, which FlopCounterMode counts as free.
        self.options = SolverOptions(time_limit=time_limit, objective="flops")
        self.least = None
        # Bytes of the parameters' gradients, made during the step: in the measured peak, not
        # in remat's activations.
        self.gradients = self.prepared.graph_gradients

    def _hint(self, budget: int):
        """The warm start: of save_all, checkpoint_blocks, chen_sqrt, greedy (at this budget,
        by FLOPs per byte) and the least-peak schedule (once smallest() ran), the fitting one of
        fewest FLOPs, else the one of least peak. The optimal strategy would pick among the
        baselines itself; the least-peak schedule is known only here."""
        from remat.errors import BudgetError
        from remat.solvers import solve

        problem = self.prepared.problem
        unbounded = sum(op.size + op.temp for op in problem.ops)
        baselines = [solve(problem, unbounded, s)
                     for s in ("save_all", "checkpoint_blocks", "chen_sqrt")]
        try:
            baselines.append(solve(problem, budget, "greedy", self.options))
        except BudgetError:
            pass
        if self.least is not None:  # the least-peak schedule, found once by smallest()
            baselines.append(self.least)
        fitting = [s for s in baselines if s.peak <= budget]
        if fitting:
            return min(fitting, key=lambda s: (s.recompute_flops, s.cost, s.peak))
        return min(baselines, key=lambda s: (s.peak, s.recompute_flops))

    def plan(self, budget: int, solver: str = "optimal"):
        """The plan whose step, gradients included (the benchmark's terms), fits `budget`."""
        from dataclasses import replace

        from remat.planner.plans.plan import plan_prepared

        options = replace(self.options, hint=self._hint(budget))
        return plan_prepared(self.case.model, self.prepared, budget=None,
                             activation_budget=max(0, budget - self.gradients), target="h100",
                             solver=solver, solver_options=options)

    def smallest(self) -> int:
        """The smallest budget (gradients included) the exact solver can meet, from its
        BudgetError."""
        import remat

        try:
            return int(self.plan(0).memory.simulated_peak)
        except remat.BudgetError as e:
            if e.smallest is None:
                raise
            self.least = e.schedule
            return int(e.smallest) + self.gradients

    def run(self, budget: int, repeats: int, solver: str = "optimal") -> RematRun:
        plan = self.plan(budget, solver)
        module = plan.module
        try:
            measured = self.case.measure(module, inside=functools.partial(inside_planned, module),
                                         repeats=repeats)
        finally:
            torch._dynamo.reset()
        return RematRun(measured=measured, predicted=int(plan.memory.simulated_peak),
                        status=getattr(plan.status, "value", str(plan.status)), gap=plan.gap)
