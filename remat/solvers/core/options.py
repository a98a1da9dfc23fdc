"""Solver controls: explicit, with defaults, never hard-coded inside a strategy."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable

# The limits `SolverOptions` chooses by problem size when the caller names none (`by_size`):
# SIZED_LIMIT seconds plus a second per SIZED_OPS_PER_SECOND ops, at most SIZED_LIMIT_CAP (the
# 70B's 20,000 ops: 30 s); a relative gap of SIZED_GAP from SIZED_GAP_OPS ops up (0 below:
# small problems are proven optimal in seconds), where the last percent is most of the time
# to prove and rarely moves the plan (the 7B: proven within 0.1 % at 3 s, FEASIBLE at 60 s).
SIZED_LIMIT = 10.0
SIZED_OPS_PER_SECOND = 1000
SIZED_LIMIT_CAP = 30.0
SIZED_GAP = 0.01
SIZED_GAP_OPS = 2000


def sized_limit(ops: int) -> float:
    """The time limit chosen for a problem of `ops` ops: SIZED_LIMIT seconds plus a second
    per SIZED_OPS_PER_SECOND ops, at most SIZED_LIMIT_CAP."""
    return min(SIZED_LIMIT_CAP, SIZED_LIMIT + ops / SIZED_OPS_PER_SECOND)


@dataclass(frozen=True, kw_only=True)
class SolverOptions:
    time_limit: float | None = None
    """Seconds the whole call of the exact solver may take (baselines, hint, bounds, both
    stages, fallbacks) before it returns its best schedule with its gap: a hard deadline,
    checked by every stage. None: chosen by the problem's size (`by_size`: 10 s plus a second
    per 1,000 ops, at most 30 s). Given or chosen, the limit is the solver's own: in
    `remat.optimize` the capture, profiling and lowering before the solve (and the eager
    probe) do not count against it, so a slow capture on a busy machine leaves the solver its
    whole limit; the report states each phase's seconds apart."""
    workers: int = 0
    """CP-SAT search workers; 0: one per core, and at least 8 (on fewer cores they share
    them: OR-Tools's portfolio needs that many to improve a first schedule,
    `remat.solvers.cpsat.search.MIN_SEARCH_WORKERS`). (The bounds' relaxations
    run the portfolio of `remat.solvers.relaxation.bound.WORKERS` that proves them, whatever this
    says.)"""
    seed: int = 0
    """Random seed of the search, for repeatable runs."""
    relative_gap: float | None = None
    """Stop once the cost is proven within this fraction of the optimum (0: prove optimality).
    None: chosen by the problem's size (`by_size`: 0 below 2,000 ops, else 0.01)."""
    deterministic: bool | None = None
    """None: True in a distributed job of several ranks (every rank that plans for itself gets
    the same plan), else False; `remat.planner.job.ranks` decides, and the solvers read None as
    False. True: plan on deterministic time (CP-SAT's `max_deterministic_time` on one worker, and
    modelled costs for the Python stages) so that the same problem, budget and options give the
    same schedule in any process. `time_limit` still bounds the wall clock: where the machine
    runs slower than planned (or the wall clock cuts a stage), the stages follow the wall clock
    and `info["deterministic"]` says so (the plan may then differ from run to run). Not the
    default outside distributed jobs: on 2 loaded cores it searched far less than the
    wall-clock mode in the same limit
    (5,000 ops at 70 %: 68 % gap against 0.5 %). False: plan on the wall clock (each stage gets
    its share of the time actually left, the portfolio of workers; not repeatable)."""
    deterministic_time: float | None = None
    """Deterministic mode: the seconds the stages plan on, counted deterministically (None: half
    of `time_limit`, `remat.solvers.cpsat.search.DETERMINISTIC_SHARE`). Set it, with a generous
    `time_limit`, for the same plan on every rank of a job however loaded the machines."""
    clock: Callable[[], float] | None = field(default=None, compare=False)
    """The clock of the call's `remat.solvers.core.deadline.Deadline` (None: `time.perf_counter`);
    tests replace it to see where a call stops without reading the wall clock."""
    cost_resolution: float = 1e-6
    """The exact solver counts recompute cost in integer units of this fraction of the least
    positive recompute cost, rounded down: every op's cost, and so every schedule's, is counted
    within this fraction (relative) below the truth, and its bounds stay bounds."""
    free_positions: bool = True
    """Let the exact solver place each recomputation at any backward op before its first use
    (a superset of schedules, sometimes with a lower peak: an earlier recomputation can free a
    large saved input sooner, or put its temp bytes where less is live). False: just in time,
    before the first backward op that needs it, directly or through another recomputation
    (make_schedule's default), which the solver proves optimal far faster."""
    objective: str = "time"
    """What the strategies minimize: "time" (recompute seconds on the target device) or "flops"
    (recompute FLOPs, seconds breaking ties); see `remat.solvers.core.objective`. Schedules come
    back evaluated in seconds and FLOPs either way."""
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
        if self.time_limit is not None and not self.time_limit > 0:
            raise ValueError(f"time_limit must be a positive number of seconds (or None: by "
                             f"problem size), not {self.time_limit!r}")
        if self.deterministic_time is not None and not self.deterministic_time > 0:
            raise ValueError(f"deterministic_time must be a positive number of seconds (or None),"
                             f" not {self.deterministic_time!r}")
        if self.relative_gap is not None and not 0 <= self.relative_gap < 1:
            raise ValueError(f"relative_gap must be in [0, 1) (or None: by problem size), not "
                             f"{self.relative_gap!r}")

    @property
    def sized(self) -> bool:
        """Whether a limit is left to `by_size`."""
        return self.time_limit is None or self.relative_gap is None

    def by_size(self, ops: int) -> "SolverOptions":
        """These options with the limits the caller left to None chosen for a problem of `ops`
        ops: what `solve` runs and the report states."""
        if not self.sized:
            return self
        limit = sized_limit(ops)
        gap = SIZED_GAP if ops >= SIZED_GAP_OPS else 0.0
        return replace(self, time_limit=limit if self.time_limit is None else self.time_limit,
                       relative_gap=gap if self.relative_gap is None else self.relative_gap)


def sized_and_stated(options: SolverOptions, ops: int) -> tuple[SolverOptions, dict]:
    """`options` with their limits chosen for a problem of `ops` ops (`by_size`), and what a
    schedule's info states of them for the report: "time_limit", "relative_gap" and "limits"
    (who chose them)."""
    sized = options.by_size(ops)
    stated = {"time_limit": sized.time_limit, "relative_gap": sized.relative_gap,
              "limits": who_chose_limits(options)}
    return sized, stated


def who_chose_limits(options: SolverOptions) -> str:
    """Who chose the time limit and relative gap of `options` (before `by_size`), as the report
    states it: "given", or chosen by the problem's size."""
    sized = [name for name, value in (("time limit", options.time_limit),
                                      ("relative gap", options.relative_gap)) if value is None]
    if not sized:
        return "given"
    return "chosen by problem size" if len(sized) == 2 else f"{sized[0]} chosen by problem size"


MODELS = ("single", "rich", "auto")
