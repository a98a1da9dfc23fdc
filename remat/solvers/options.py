"""Solver controls: explicit, with defaults, never hard-coded inside a strategy."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass(frozen=True, kw_only=True)
class SolverOptions:
    time_limit: float = 60.0
    """Seconds the whole call of the exact solver may take (baselines, hint, bounds, both
    stages, fallbacks) before it returns its best schedule with its gap."""
    workers: int = 0
    """CP-SAT search workers; 0 lets OR-Tools pick one per core. (The bounds' relaxations
    run the portfolio of `remat.solvers.bound.WORKERS` that proves them, whatever this says.)"""
    seed: int = 0
    """Random seed of the search, for repeatable runs."""
    relative_gap: float = 0.0
    """Stop once the cost is proven within this fraction of the optimum (0: prove optimality)."""
    cost_resolution: float = 1e-6
    """The exact solver counts recompute cost in integer units of this fraction of the least
    positive recompute cost, rounded down: every op's cost, and so every schedule's, is counted
    within this fraction (relative) below the truth, and its bounds stay bounds."""
    free_positions: bool = True
    """Let the exact solver place each recomputation at any backward op before its first use
    (a superset of schedules, sometimes with a lower peak: an earlier recomputation can free a
    large saved input sooner, or put its temp bytes where less is live). False: just in time,
    before the first backward op that needs it, directly or through another recomputation
    (DESIGN.md's rule and make_schedule's default), which the solver proves optimal far faster."""
    objective: str = "time"
    """What the strategies minimize: "time" (recompute seconds on the target device) or "flops"
    (recompute FLOPs, seconds breaking ties); see `remat.solvers.objective`. Schedules come back
    evaluated in seconds and FLOPs either way."""
    model: str = "auto"
    """The execution model the exact solver searches: "single" (each value recomputed at most
    once, in the backward), "rich" (up to `max_copies` recomputations per value, within the
    forward or the backward, and offload to host where the problem has `host_bandwidth`), or
    "auto" (the single model first; the rich one only where a bound proven over the rich space
    leaves room to gain, started from the single model's plan, so never worse). The rich model
    places copies freely: with `free_positions=False`, "auto" is the single model."""
    max_copies: int = 2
    """Further recomputations per value the rich model allows (`Schedule.again`: within the
    forward, or in the backward after the first backward recomputation)."""
    hint: Any = None
    """A Schedule to start the search from (the best baseline when None)."""
    on_solution: Callable[[dict], None] | None = field(default=None, compare=False)
    """Called with {"time", "cost", "bound"} for every improving schedule the search finds."""
    log: bool = False
    """Let the solver log its search to the `remat.solvers` logger."""

    def __post_init__(self) -> None:
        if self.model not in MODELS:
            raise ValueError(f"unknown model {self.model!r}; choose one of {', '.join(MODELS)}")
        if not (isinstance(self.max_copies, int) and self.max_copies >= 0):
            raise ValueError(f"max_copies must be a non-negative int, not {self.max_copies!r}")


MODELS = ("single", "rich", "auto")
