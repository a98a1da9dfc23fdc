"""Running CP-SAT: the model for the options, the solver's parameters, the anytime trace of
every improving schedule, and the progress line logged while a search runs.
"""
from __future__ import annotations

import logging
import math
import threading
import time

from ortools.sat.python import cp_model

from remat.solvers.cpsat.free_model import FreeModel
from remat.solvers.cpsat.jit_model import JitModel
from remat.solvers.cpsat.units import Units
from remat.solvers.options import SolverOptions
from remat.solvers.problem import Problem

logger = logging.getLogger(__name__)

# Seconds between progress lines while `optimal` runs.
PROGRESS_SECONDS = 5.0


def build_model(problem: Problem, units: Units, options: SolverOptions) -> FreeModel | JitModel:
    return (FreeModel if options.free_positions else JitModel)(problem, units)


def cp_solver(options: SolverOptions, seconds: float, progress: "Progress | None" = None,
              units: Units | None = None) -> cp_model.CpSolver:
    solver = cp_model.CpSolver()
    params = solver.parameters
    params.max_time_in_seconds = max(seconds, 0.01)
    if options.workers:
        params.num_workers = options.workers
    params.random_seed = options.seed
    params.relative_gap_limit = options.relative_gap
    # Probing was most of the time outside the search: 4.6 s of a 12.7 s presolve at 5,000 ops
    # (free model), 15-18 s twice at 500 ops (just-in-time model), before any search started.
    params.cp_model_probing_level = 0
    if options.log:
        params.log_search_progress = True
        params.log_to_stdout = False
        solver.log_callback = logger.info
    if progress is not None and units is not None:
        solver.best_bound_callback = lambda bound: progress.update(bound=bound * units.cost)
    return solver


class Progress:
    """What the running stage has: its incumbent cost and proven bound (seconds), logged at INFO
    every PROGRESS_SECONDS by a timer thread while `optimal` runs (a context manager)."""

    def __init__(self, time_limit: float):
        self.start, self.time_limit = time.perf_counter(), time_limit
        self.stage, self.cost, self.bound = "starting", None, None
        self.stages: list[tuple[str, float]] = []  # (stage, seconds since the start) as entered
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._tick, name="remat-progress", daemon=True)

    def update(self, *, stage: str | None = None, cost: float | None = None,
               bound: float | None = None) -> None:
        if stage is not None:
            self.stage = stage
            self.stages.append((stage, round(time.perf_counter() - self.start, 3)))
        if cost is not None:
            self.cost = cost
        if bound is not None and math.isfinite(bound):
            self.bound = max(bound, self.bound or 0.0)

    def line(self) -> str:
        cost = "none yet" if self.cost is None else f"{self.cost:.6g} s"
        bound = "none yet" if self.bound is None else f"{self.bound:.6g} s"
        return (f"optimal: {time.perf_counter() - self.start:.1f} s of {self.time_limit:g} s, "
                f"{self.stage}; best recompute cost {cost}, bound {bound}")

    def _tick(self) -> None:
        while not self._stop.wait(PROGRESS_SECONDS):
            logger.info(self.line())

    def __enter__(self) -> "Progress":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


class Trace(cp_model.CpSolverSolutionCallback):
    """The anytime trace: every improving schedule's cost and the bound at that moment, in
    seconds (the model's, rounded down: within `slack` units below the true cost). Stops the
    search once a schedule's true cost is certainly at most `enough`."""

    def __init__(self, units: Units, start: float, user, progress: Progress,
                 enough: float = -math.inf, slack: int = 0):
        super().__init__()
        self.units, self.start, self.user, self.progress = units, start, user, progress
        self.enough, self.slack, self.trace = enough, slack, []

    def on_solution_callback(self) -> None:
        entry = {"time": time.perf_counter() - self.start,
                 "cost": self.ObjectiveValue() * self.units.cost,
                 "bound": self.BestObjectiveBound() * self.units.cost}
        self.trace.append(entry)
        self.progress.update(cost=entry["cost"], bound=entry["bound"])
        if self.user is not None:
            self.user(entry)
        if (self.ObjectiveValue() + self.slack) * self.units.cost <= self.enough:
            self.StopSearch()
