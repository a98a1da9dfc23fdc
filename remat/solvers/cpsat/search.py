"""Running CP-SAT: the model for the options, the call's deadline and the solver's parameters
(every solve runs under the deadline's watchdog), the anytime trace of every improving
schedule, and the progress line logged while a search runs.
"""
from __future__ import annotations

import logging
import math
import os
import threading
import time

from ortools.sat.python import cp_model

from remat.solvers.cpsat.free_model import FreeModel
from remat.solvers.cpsat.jit_model import JitModel
from remat.solvers.cpsat.units import Units
from remat.solvers.core.deadline import DTIME_WEIGHT, Deadline
from remat.solvers.core.options import SolverOptions
from remat.solvers.core.problem import Problem

logger = logging.getLogger(__name__)

# Seconds between progress lines while `optimal` runs.
PROGRESS_SECONDS = 5.0
# In deterministic mode, the share of the time limit the stages plan on, in seconds counted
# deterministically (CP-SAT's deterministic time weighted to CPU seconds, `DTIME_WEIGHT`, and the
# modelled cost of the Python stages, `modelled`); the rest is the margin before the wall clock
# cuts a stage on a slow or loaded machine (2 cores at a load of 6 to 8 give a process about
# 0.4 CPU seconds a second).
DETERMINISTIC_SHARE = 0.5
# CP-SAT workers when the options name none: one per core, and never fewer than this. OR-Tools
# alone gives one per core, and with fewer than eight its portfolio has no room for the
# neighbourhood-search workers that improve a first schedule. On 2 cores, the compiled Qwen2
# of benchmarks/inductor.py at its per-block allowance (1,028 ops): 2 workers kept the hint's
# 3.49e9 recompute FLOPs for all of 60 s, 8 found 3.22e9 (0.03 % above the bound) in 14 s in
# one run, 3.36e9 in 33 s in another; at the default limit (11 s) 3.36e9 against 3.49e9, and
# the same plans as 2 workers at two other budgets and on the Llama of examples/llama.py.
MIN_SEARCH_WORKERS = 8


def build_model(problem: Problem, units: Units, options: SolverOptions,
                deadline: Deadline | None = None) -> FreeModel | JitModel:
    """The single model for the options; OutOfTime when `deadline` passes while it is built."""
    return (FreeModel if options.free_positions else JitModel)(problem, units, deadline)


def deadline_of(options: SolverOptions) -> Deadline:
    """The deadline of a whole call of `optimal`: `options.time_limit` of wall clock; in
    deterministic mode the stages plan on `options.deterministic_time` deterministic seconds
    (DETERMINISTIC_SHARE of the limit by default, which leaves the rest for a loaded machine
    before the wall clock cuts anything)."""
    limit = options.time_limit
    if limit is None:
        raise ValueError("optimal needs a time limit: solve() chooses one by problem size "
                         "(SolverOptions.by_size)")
    planned = None
    if options.deterministic:
        planned = options.deterministic_time or DETERMINISTIC_SHARE * limit
    return Deadline(limit, clock=options.clock or time.perf_counter,
                    deterministic=options.deterministic, planned=planned)


def deadline_info(deadline: Deadline) -> dict:
    """What a result's `info` says of its deadline: the stages as entered, the first that ran
    out of time, and, in deterministic mode, whether the wall clock cut it."""
    info: dict = {"stages": deadline.stages}
    if deadline.stopped is not None:
        info["stopped_in"] = f"{deadline.stopped[0]} ({deadline.stopped[1]})"
    if deadline.deterministic:
        info["deterministic"] = (True if deadline.cut is None else
                                 f"cut by the wall-clock limit in {deadline.cut}: this plan may "
                                 "differ from run to run")
    return info


def cp_solver(options: SolverOptions, deadline: Deadline, seconds: float | None = None,
              progress: "Progress | None" = None, units: Units | None = None
              ) -> cp_model.CpSolver:
    """A CP-SAT solver with the options' parameters, limited to `seconds` (default: all that
    is left) of `deadline`; run it inside `deadline.guard(solver)`, which stops it there."""
    solver = cp_model.CpSolver()
    params = solver.parameters
    deadline.limit_solver(params, seconds, DTIME_WEIGHT["model"])
    params.num_workers = options.workers or max(MIN_SEARCH_WORKERS, os.cpu_count() or 1)
    if deadline.deterministic:
        # One worker's search is deterministic under a deterministic-time limit. (CP-SAT's
        # interleaved search is too, with more workers, but on 2 shared cores it took 9 to 20 s
        # for what one worker did in 0.2 to 1 s.)
        params.num_workers = 1
    params.random_seed = options.seed
    params.relative_gap_limit = options.relative_gap or 0.0
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


def run_solver(solver: cp_model.CpSolver, model: cp_model.CpModel, deadline: Deadline,
               stage: str, callback: cp_model.CpSolverSolutionCallback | None = None):
    """`solver.Solve(model, callback)`, stopped by `deadline`'s watchdog; its status."""
    with deadline.guard(solver, stage, DTIME_WEIGHT["model"]):
        return solver.Solve(model, callback)


class Progress:
    """What the running stage has: its incumbent cost and proven bound (seconds), logged at INFO
    every PROGRESS_SECONDS by a timer thread while `optimal` runs (a context manager). Stages
    are recorded in the call's deadline."""

    def __init__(self, deadline: Deadline):
        self.deadline = deadline
        self.stage, self.cost, self.bound = "starting", None, None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._tick, name="remat-progress", daemon=True)

    @property
    def stages(self) -> tuple[tuple[str, float], ...]:
        return self.deadline.stages

    def update(self, *, stage: str | None = None, cost: float | None = None,
               bound: float | None = None) -> None:
        if stage is not None:
            self.stage = stage
            self.deadline.enter(stage)
        if cost is not None:
            self.cost = cost
        if bound is not None and math.isfinite(bound):
            self.bound = max(bound, self.bound or 0.0)

    def line(self) -> str:
        cost = "none yet" if self.cost is None else f"{self.cost:.6g} s"
        bound = "none yet" if self.bound is None else f"{self.bound:.6g} s"
        wall = self.deadline.clock() - self.deadline.wall_start
        limit = self.deadline.wall_end - self.deadline.wall_start
        return (f"optimal: {wall:.1f} s of {limit:g} s, {self.stage}; best recompute cost "
                f"{cost}, bound {bound}")

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
