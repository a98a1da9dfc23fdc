"""The memory/compute trade-off curve (`sweep`) and the largest micro-batch that fits
(`max_batch`).

`sweep` captures and profiles once and solves once per budget, in increasing order, each solve
warm-started (`SolverOptions.hint`) from the previous schedule: a schedule that fits a budget
fits every larger one, so the hint is always feasible.
"""
from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from tabulate import tabulate

from remat.errors import BudgetError
from remat.planner.job.budget import format_size, parse_size
from remat.planner.plans.plan import Plan, plan_prepared
from remat.planner.plans.prepare import Prepared, prepare, warn_eval_mode
from remat.planner.plans.report import price
from remat.planner.job.training import Training
from remat.solvers import Schedule, SolverOptions, Strategy, solve

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Point:
    """One budget of the sweep; `peak` and the rest are None where nothing fits."""

    strategy: str
    budget: int | None
    peak: int | None
    """The whole step's bytes at `budget` (its fragmentation margin included)."""
    needs: int | None = None
    """The smallest whole-step budget this point's schedule fits: the curve's x-axis, the same
    measure for the plans and the baselines."""
    activation_peak: int | None = None
    recompute_pct: float | None = None
    mfu: float | None = None
    hfu: float | None = None
    status: str = "INFEASIBLE"
    gap: float | None = None

    @property
    def feasible(self) -> bool:
        return self.peak is not None

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "feasible": self.feasible}


@dataclass(frozen=True)
class SweepResult:
    points: tuple[Point, ...]
    """The plan at each budget, in increasing budget order."""
    baselines: tuple[Point, ...]
    """Save-all and checkpoint-every-block: one point each (they do not depend on the budget)."""
    smallest_feasible: int | None
    """The smallest whole-step budget that fits (exact with the optimal solver)."""
    knee: Point | None
    """The feasible point farthest from the chord between the curve's ends: past it, more
    memory buys little less recomputation."""
    plans: tuple[Plan | None, ...] = dataclasses.field(default=(), compare=False, repr=False)

    def to_dict(self) -> dict:
        return {"points": [p.to_dict() for p in self.points],
                "baselines": [p.to_dict() for p in self.baselines],
                "smallest_feasible": self.smallest_feasible,
                "knee": self.knee.to_dict() if self.knee else None}

    def render(self) -> str:
        pct = lambda x: "" if x is None else f"{100 * x:.1f} %"  # noqa: E731
        rows = [[p.strategy, format_size(p.budget) if p.budget else "",
                 format_size(p.peak) if p.feasible else "does not fit",
                 format_size(p.needs) if p.feasible else "",
                 "" if p.recompute_pct is None else f"{p.recompute_pct:.2f} %",
                 pct(p.mfu), pct(p.hfu), p.status,
                 "<- knee" if p is self.knee else ""]
                for p in (*self.points, *self.baselines)]
        text = tabulate(rows, headers=["strategy", "budget", "peak", "fits from", "recompute", "MFU (pred.)",
                                       "HFU (pred.)", "status", ""], disable_numparse=True)
        smallest = ("none of the budgets fits" if self.smallest_feasible is None
                    else f"{format_size(self.smallest_feasible)} "
                         f"({self.smallest_feasible:,} bytes)")
        return f"{text}\nsmallest budget that fits: {smallest}"

    __str__ = render

    def plot(self, path: str) -> str:
        """Recompute overhead against the step's peak memory, the baselines beside; writes a
        PNG to `path` and returns a line saying so (or why not: matplotlib is optional)."""
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            return f"no plot written to {path}: matplotlib is not installed (pip install matplotlib)"
        feasible = [p for p in self.points if p.feasible]
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot([p.needs / 1e9 for p in feasible], [p.recompute_pct for p in feasible], "o-",
                label=f"{self.points[0].strategy if self.points else 'plan'}")
        for p, marker in zip(self.baselines, "sD^v"):
            ax.plot([p.needs / 1e9], [p.recompute_pct], marker, label=p.strategy)
        if self.knee is not None:
            ax.annotate("knee", (self.knee.needs / 1e9, self.knee.recompute_pct),
                        textcoords="offset points", xytext=(8, 8))
        ax.set_xlabel("peak memory of the step: the smallest budget that fits (GB)")
        ax.set_ylabel("recompute FLOPs (% of model FLOPs)")
        ax.grid(True, alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
        return f"plot written to {path}"


def sweep(model: Any, budgets: Sequence[int | str], *, example_inputs: Sequence[Any] = (),
          example_kwargs: dict[str, Any] | None = None, training: Training = Training(),
          target: str = "h100", solver: Strategy | str = Strategy.OPTIMAL,
          solver_options: SolverOptions | None = None, loss_fn: Callable | None = None,
          prepared: Prepared | None = None) -> SweepResult:
    """One plan per whole-step budget: the trade-off between memory and recomputation. The
    step is ``model(*example_inputs, **example_kwargs)`` and its loss, as in `optimize` (a
    Hugging Face model: ``example_kwargs={"input_ids": ..., "labels": ...}``)."""
    sizes = sorted({parse_size(b) for b in budgets})
    if prepared is None:
        warn_eval_mode(model, "remat.sweep")
        prepared = prepare(model, example_inputs, example_kwargs=example_kwargs,
                           training=training, target=target, loss_fn=loss_fn)
    return sweep_prepared(model, prepared, sizes, target=target, solver=solver,
                          solver_options=solver_options)


def sweep_prepared(model: Any, prepared: Prepared, budgets: Sequence[int], *, target: str,
                   solver: Strategy | str = Strategy.OPTIMAL,
                   solver_options: SolverOptions | None = None) -> SweepResult:
    strategy = Strategy(solver)
    options = solver_options or SolverOptions()
    points, plans, smallest, hint = [], [], None, None
    for k, budget in enumerate(sorted(budgets)):
        log.info("sweep %d/%d: budget %s", k + 1, len(budgets), format_size(budget))
        try:
            plan = plan_prepared(model, prepared, budget=budget, activation_budget=None,
                                 target=target, solver=strategy,
                                 solver_options=dataclasses.replace(options, hint=hint))
        except BudgetError as e:
            # A figure only found (BudgetError.proven False) is not kept: the solver's at
            # budget 0 is asked below instead.
            if e.smallest is not None and e.proven is not False:
                smallest = e.smallest
            points.append(Point(strategy=strategy.value, budget=budget, peak=None))
            plans.append(None)
            continue
        hint = plan.schedule
        points.append(_point(prepared, plan.schedule, budget, target, strategy.value))
        plans.append(plan)
    if smallest is None:  # every budget fits: ask the solver how low it can go
        smallest = smallest_feasible(prepared, strategy, options)
    baselines = tuple(_point(prepared, schedule, None, target, s.value)
                      for s, schedule in prepared.baselines.items())  # each at what it needs
    return SweepResult(points=tuple(points), baselines=baselines, smallest_feasible=smallest,
                       knee=knee([p for p in points if p.feasible]), plans=tuple(plans))


def smallest_feasible(prepared: Prepared, strategy: Strategy,
                      options: SolverOptions | None = None) -> int:
    """The smallest whole-step budget that `strategy` fits (the smallest any schedule fits,
    for the optimal strategy): the state plus its smallest activation peak."""
    try:
        peak = solve(prepared.problem, 0, strategy, options).peak
    except BudgetError as e:
        peak = e.smallest
    return prepared.needs(peak)


def default_budgets(prepared: Prepared, count: int = 8) -> list[int]:
    """`count` whole-step budgets evenly from 90 % of what checkpointing every block needs to
    what saving everything needs: the stretch where the plan has choices to make."""
    needs = [prepared.needs(s.peak) for s in prepared.baselines.values()]
    low, high = int(0.9 * min(needs)), max(needs)
    return sorted({low + (high - low) * k // (count - 1) for k in range(count)})


def _point(prepared: Prepared, schedule: Schedule, budget: int | None, target: str,
           strategy: str) -> Point:
    from remat.fx_passes.measuring.devices import device

    chip = device(target)
    needs = prepared.needs(schedule.peak)
    memory = prepared.step_memory(schedule, needs if budget is None else budget)
    cost = price(prepared.problem, schedule, device=chip.name,
                 peak_flops=chip.peak_flops(prepared.training.compute_dtype),
                 time_source="predicted")
    return Point(strategy=strategy, budget=memory.budget, peak=memory.total, needs=needs,
                 activation_peak=memory.activation_peak, recompute_pct=cost.recompute_pct,
                 mfu=cost.mfu, hfu=cost.hfu, status=schedule.status.value, gap=schedule.gap)


def knee(points: Sequence[Point]) -> Point | None:
    """The point of the (needed budget, recompute) curve farthest from the chord between its ends, both
    axes scaled to [0, 1] (Satopaa et al.'s "Kneedle"); None with fewer than three points or a
    flat curve."""
    if len(points) < 3:
        return None
    xs = [p.needs for p in points]
    ys = [p.recompute_pct for p in points]
    dx, dy = (max(xs) - min(xs)) or 1, (max(ys) - min(ys))
    if dy == 0:
        return None
    norm = [((x - min(xs)) / dx, (y - min(ys)) / dy) for x, y in zip(xs, ys)]
    (x0, y0), (x1, y1) = norm[0], norm[-1]
    length = math.hypot(x1 - x0, y1 - y0) or 1
    distance = [abs((y1 - y0) * x - (x1 - x0) * y + x1 * y0 - y1 * x0) / length for x, y in norm]
    best = max(range(len(points)), key=distance.__getitem__)
    return points[best] if 0 < best < len(points) - 1 else None


# ----------------------------------------------------------------------------- max_batch


@dataclass(frozen=True)
class BatchResult:
    micro_batch: int
    """The largest micro-batch whose step fits the budget with the plan."""
    accumulation_steps: int | None
    """Gradient-accumulation steps for the requested global batch (per data-parallel rank)."""
    micro_batch_used: int | None
    """The micro-batch that splits the global batch evenly into that many steps."""
    plan: Plan = dataclasses.field(repr=False, compare=False)
    tried: tuple[tuple[int, bool], ...] = ()
    """(micro-batch, fits) in the order they were tried."""

    def to_dict(self) -> dict:
        return {"micro_batch": self.micro_batch, "accumulation_steps": self.accumulation_steps,
                "micro_batch_used": self.micro_batch_used, "peak": self.plan.peak,
                "tried": [list(t) for t in self.tried]}


def max_batch(model: Any, budget: int | str, *,
              make_inputs: Callable[[int], Sequence[Any]] | None = None,
              make_kwargs: Callable[[int], dict[str, Any]] | None = None,
              global_batch: int | None = None, training: Training = Training(),
              target: str = "h100", solver: Strategy | str = Strategy.OPTIMAL,
              solver_options: SolverOptions | None = None, loss_fn: Callable | None = None,
              limit: int = 1 << 16) -> BatchResult:
    """The largest micro-batch (at most `limit`) whose step fits `budget` with the plan of
    `solver`, found by doubling and then bisection (one capture per size tried);
    `make_inputs(n)` builds the example inputs of a micro-batch of n, `make_kwargs(n)` its
    keyword inputs (`optimize`'s `example_inputs` and `example_kwargs`; a Hugging Face model:
    ``make_kwargs=lambda n: {"input_ids": ..., "labels": ...}``); one of them at least. With
    `global_batch`, also the gradient-accumulation steps that reach it on each of the
    `training.data_parallel` ranks. Raises the BudgetError of micro-batch 1 when not even that
    fits."""
    if make_inputs is None and make_kwargs is None:
        raise ValueError("max_batch needs the inputs of a micro-batch of n: make_inputs(n) "
                         "(positional, a tuple) or make_kwargs(n) (keywords, a dict, e.g. "
                         "{\"input_ids\": ..., \"labels\": ...}), or both")
    size = parse_size(budget)
    warn_eval_mode(model, "remat.max_batch")
    tried: list[tuple[int, bool]] = []
    best: tuple[int, Plan] | None = None

    def attempt(n: int) -> bool:
        nonlocal best
        prepared = prepare(model, make_inputs(n) if make_inputs is not None else (),
                           example_kwargs=make_kwargs(n) if make_kwargs is not None else None,
                           training=training, target=target, loss_fn=loss_fn)
        try:
            plan = plan_prepared(model, prepared, budget=size, activation_budget=None,
                                 target=target, solver=solver, solver_options=solver_options)
        except BudgetError:
            tried.append((n, False))
            if n == 1:
                raise
            return False
        tried.append((n, True))
        if best is None or n > best[0]:
            best = (n, plan)
        return True

    low, high = 1, None  # low fits; high (when known) does not
    attempt(1)
    while high is None and low < limit:
        n = min(2 * low, limit)
        if attempt(n):
            low = n
        else:
            high = n
    while high is not None and high - low > 1:
        middle = (low + high) // 2
        if attempt(middle):
            low = middle
        else:
            high = middle
    steps = used = None
    if global_batch is not None:
        per_rank = math.ceil(global_batch / training.data_parallel)
        steps = math.ceil(per_rank / low)
        used = math.ceil(per_rank / steps)
    return BatchResult(micro_batch=low, accumulation_steps=steps, micro_batch_used=used,
                       plan=best[1], tried=tuple(tried))
