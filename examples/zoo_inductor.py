"""The zoo's two Inductor rows per architecture (`python examples/hf_zoo.py --inductor`).

- ``inductor``: ``remat.optimize(model, activation_budget=B, example_kwargs=kwargs,
  compile=True)`` at the compiled row's budget B; ``plan.module(**kwargs)`` and the backward
  run as the zoo runs compiled plans. Its prediction (`plan.activation_peak`) is the reading of
  one measured Inductor step (`remat.planner.plans.inductor_check`), so the row checks that
  reading against the zoo's own; the note gives the op-by-op simulated peak beside it.
- ``eager+compile``: ``remat.optimize(model, activation_budget=B, example_kwargs=kwargs,
  execution="eager", compile=True)`` at the eager row's budget B: an eager plan accepted on the
  allocator's reading of ``torch.compile`` of the applied model
  (`remat.planner.plans.step_reading`); ``plan.module`` (that compiled model) and the backward
  run as the zoo runs eager plans. Its prediction is that reading; the note gives the eager
  timeline's peak beside it.

Both are judged as the zoo's rows are: the allocator's activation peak (`activation_peak`) and
the gradients against eager PyTorch's (`grad_diff`), here within `INDUCTOR_SUMS`, or within
`PLAIN_FACTOR` times plain torch.compile's own difference on the model. Both run
with Inductor's ``fallback_random`` on (remat's compiled step sets it itself; the eager+compile
row is planned and read under it): aten's random
kernels on eager's generator, so the dropout masks are eager's and the gradients comparable.
"""
from __future__ import annotations

import copy
import time

import torch

import remat
from examples.hf_zoo import (Row, _first_line, activation_peak, grad_diff,
                             training_step)
from remat.planner.job.budget import format_size
from remat.solvers import SolverOptions

MODES = ("inductor", "eager+compile")

# Relative to the largest |eager gradient| (hf_zoo.grad_diff). Inductor runs the step's sums
# in its own order (fused reductions, a bias gradient summed over every token in vectorized
# partial sums) and its vectorized exp/tanh/erf differ from aten's by an ulp or so. A sum of
# n float32 terms reordered moves by at most about n * 1.2e-7 of the terms' size; the zoo's
# largest per-gradient sums are over the tokens of a batch (ViT: 13 images of 225 patches,
# 2925 terms; 3.5e-4 by that bound). So 1e-3: room for the largest reordered sum of the zoo,
# and still about a hundred times below what a wrong recomputation (another dropout mask, a
# stale value) moves a gradient by, a sizeable fraction of it.
INDUCTOR_SUMS = 1e-3
# Where a row is above that, plain torch.compile of the same model (no remat) is run against
# eager's gradients too: a row within PLAIN_FACTOR times its difference is Inductor's own
# numerics on that model (Falcon's fused parallel attention and MLP: 4.7e-3 with and without
# remat), a row beyond it is reported. Twice: remat's step runs Inductor's sums once more in
# each recomputation, whose order may differ again.
PLAIN_FACTOR = 2.0


def inductor_rows(name: str, family: str, base: torch.nn.Module, kwargs: dict,
                  expected: list, budget: int | None, eager_plan, eager_budget: int | None,
                  options: SolverOptions, only: tuple[str, ...] = MODES) -> list[Row]:
    """The rows of `name` in `only` (module doc): `budget` is the compiled row's budget,
    `eager_plan` the eager row's plan (None where it failed: the row says so)."""
    rows = []
    if "inductor" in only:
        rows.append(remat_inductor(name, family, base, kwargs, expected, budget, options))
    if "eager+compile" in only:
        rows.append(applied_compiled(name, family, base, kwargs, expected, eager_plan,
                                     eager_budget, options))
    return rows


def remat_inductor(name, family, base, kwargs, expected, budget, options) -> Row:
    row = Row(name, family, "inductor", budget=budget or 0)
    if budget is None:
        row.error = "no compiled budget (the compiled row failed)"
        return row
    return _planned_row(row, base, kwargs, expected, dict(compile=True, solver_options=options))


def applied_compiled(name, family, base, kwargs, expected, eager_plan, eager_budget,
                     options) -> Row:
    row = Row(name, family, "eager+compile", budget=eager_budget or 0)
    if eager_plan is None:
        row.error = "no eager plan (the eager row failed)"
        return row
    # Inductor's config as the row runs it: the reading the plan is accepted on is made under it
    with torch._inductor.config.patch(fallback_random=True):
        return _planned_row(row, base, kwargs, expected,
                            dict(execution="eager", compile=True, solver_options=options))


def _planned_row(row: Row, base, kwargs: dict, expected: list, settings: dict) -> Row:
    """`row` planned at its budget with `settings` on a fresh copy of `base` and run. Where
    the budget is refused with a least found (under Inductor, by measurement), the row is
    planned again once at that least, and its note says so."""
    torch._dynamo.reset()
    model = copy.deepcopy(base)
    start = time.perf_counter()
    refused = ""
    try:
        try:
            plan = remat.optimize(model, activation_budget=row.budget, example_kwargs=kwargs,
                                  **settings)
        except remat.BudgetError as e:
            if e.smallest is None or e.smallest <= row.budget:
                raise
            refused = f"{row.budget:,} refused, planned at the least found; "
            row.budget = e.smallest
            torch._dynamo.reset()
            plan = remat.optimize(model, activation_budget=row.budget, example_kwargs=kwargs,
                                  **settings)
    except Exception as e:  # the table reports every failure with its cause
        row.error = f"plan: {refused}{_first_line(e)}"
        return row
    finally:
        row.plan_seconds = time.perf_counter() - start
    row.status, row.gap = plan.status.value, plan.gap
    row.predicted = plan.activation_peak
    check = plan.inductor
    replans = len(check.readings) - 1
    row.note = (f"{refused}simulated {check.predicted:,}"
                + (f"; {replans} re-plan(s)" if replans else ""))
    return _run(row, plan.module, model, kwargs, expected, base)


def _run(row: Row, call, model: torch.nn.Module, kwargs: dict, expected: list,
         base: torch.nn.Module) -> Row:
    try:
        step = training_step(call, kwargs, seed=7)
        for _ in range(2):  # the first call compiles
            step()
        row.allocator = activation_peak(step, model)
        row.grad_diff = grad_diff(expected, model)
    except Exception as e:
        row.error = f"run: {_first_line(e)}"
    if row.grad_diff is not None and row.grad_diff > INDUCTOR_SUMS:
        plain = plain_compile_diff(base, kwargs, expected)
        if plain is not None and row.grad_diff <= PLAIN_FACTOR * plain:
            row.note = (row.note + "; " if row.note else "") + (
                f"gradients as plain torch.compile's ({plain:.0e} from eager's)")
        else:
            row.error = (row.error or "") + (
                f"gradients {row.grad_diff:.0e} above {INDUCTOR_SUMS:.0e}"
                + ("" if plain is None else f" and {PLAIN_FACTOR:g}x plain torch.compile's "
                   f"{plain:.0e}"))
    return row


def plain_compile_diff(base: torch.nn.Module, kwargs: dict, expected: list) -> float | None:
    """Plain ``torch.compile`` of a copy of `base` (no remat), its gradients against eager's
    (`grad_diff`), under the rows' ``fallback_random``; None where it fails."""
    torch._dynamo.reset()
    model = copy.deepcopy(base)
    try:
        with torch._inductor.config.patch(fallback_random=True):
            step = training_step(torch.compile(model), kwargs, seed=7)
            step()
            return grad_diff(expected, model)
    except Exception:  # the row reports its own difference without the comparison
        return None
    finally:
        torch._dynamo.reset()


def summary(rows: list[Row]) -> str:
    """One line per Inductor row above its prediction, and the count within tolerance."""
    mine = [r for r in rows if r.mode in MODES]
    ran = [r for r in mine if r.over is not None]
    lines = [f"{len(ran)} of {len(mine)} Inductor rows ran; "
             f"{sum(r.grad_diff <= INDUCTOR_SUMS for r in ran)} with gradients within "
             f"{INDUCTOR_SUMS:.0e} of eager's (relative to the largest)"]
    for r in ran:
        if r.allocator > r.predicted:
            lines.append(f"  above: {r.arch} {r.mode} by {format_size(r.allocator - r.predicted)}"
                         f" ({r.over:+.2f} %)")
    return "\n".join(lines)
