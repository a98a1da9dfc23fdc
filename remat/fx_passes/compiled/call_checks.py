"""A planned module's compiled steps, and the checks every training call passes before one runs.

A plan for fixed shapes is one compiled step. A plan for a range of shapes
(`remat.fx_passes.tracing.dynamic`) is one compiled step per bucket of the range, each a
graph whose sizes are symbols (one compilation serves every size of the bucket), with the
bucket's own problem and schedule; a step is compiled at its bucket's first call, and never
again for another size in it. Before any step runs, the call is checked against the planned
one (`remat.fx_passes.tracing.call_checks.CallSpec`): a shape outside the range, another
dtype, autocast state or set of trainable parameters is named in a RematError, with the
remedy, instead of surfacing as a mismatch of graph nodes.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from remat.errors import RematError
from remat.fx_passes.tracing.call_checks import CallSpec
from remat.fx_passes.tracing.dynamic import Bucket
from remat.solvers.core.problem import Problem
from remat.solvers.core.schedule import Schedule

__all__ = ["PlannedSteps", "explained"]

# make(problem, schedule, bucket) -> the compiled step
StepMaker = Callable[[Problem, Schedule, Bucket | None], Callable]


class PlannedSteps:
    """The compiled step each call runs: one, or one per bucket of a planned range."""

    def __init__(self, make: StepMaker, problem: Problem, schedule: Schedule,
                 spec: CallSpec | None = None,
                 buckets: dict[Bucket, tuple[Problem, Schedule]] | None = None):
        self.spec = spec
        self.shape_range = spec.shape_range if spec is not None else None
        if self.shape_range is not None and not buckets:
            raise RematError("a plan for a range of shapes needs a problem and a schedule per "
                             "bucket of the range")
        self._make = make
        self._plans = dict(buckets or {})
        self._steps: dict[Bucket | None, Callable] = {}
        if self.shape_range is None:
            self._steps[None] = make(problem, schedule, None)

    @property
    def compiled(self) -> list:
        """The buckets whose steps exist (None: the one step of fixed shapes)."""
        return list(self._steps)

    @torch.compiler.disable
    def check(self, model: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        """The training call's checks (grad enabled: a call under no_grad is no training
        step, and the planned module's mode check deals with the train/eval mode)."""
        if self.spec is not None and torch.is_grad_enabled():
            self.spec.check(model, args, kwargs)

    @torch.compiler.disable
    def step_for(self, model: torch.nn.Module, args: tuple, kwargs: dict) -> Callable:
        if self.shape_range is None:
            return self._steps[None]
        try:
            bucket = self.shape_range.bucket_of(self.shape_range.sizes_of(args, kwargs))
        except KeyError:
            self.spec.check(model, args, kwargs)  # names the size outside the range
            raise
        if bucket not in self._steps:
            problem, schedule = self._plans[bucket]
            self._steps[bucket] = self._make(problem, schedule, bucket)
        return self._steps[bucket]


def explained(step: Callable, bucket: Bucket | None) -> Callable:
    """`step`, whose refusal by dynamo to keep a size symbolic is a RematError naming it."""
    if bucket is None:
        return step

    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return step(*args, **kwargs)
        except Exception as e:
            violation = _constraint_violation(e)
            if violation is None:
                raise
            raise RematError(
                f"the model's code specializes a size of the planned range ({bucket}) when "
                f"compiled at this call's shapes: {violation}; plan a range within which the "
                "code takes one path") from e

    return run


def _constraint_violation(error: BaseException | None) -> str | None:
    while error is not None:
        if type(error).__name__ == "ConstraintViolationError":
            return str(error).splitlines()[0]
        error = error.__cause__ or error.__context__
    return None
