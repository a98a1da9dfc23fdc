"""The report's solver section: how the plan was found (strategy, status, bound, gap, the
limits and who chose them), what each phase of the planning call took, and where the plan is a
last resort or ends far from its bound, what to do about it (`remat.planner.plans.gap_advice`).
Torch-free."""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from types import MappingProxyType

from tabulate import tabulate

from remat.planner.job.budget import format_size
from remat.planner.plans.gap_advice import GapAdvice, gap_advice
from remat.solvers import Schedule

__all__ = ["SolverSummary", "phase_line", "phases_of", "solver_table", "with_phases"]

# The key of a schedule's info that holds the planning call's phases.
PHASES_KEY = "planning_phases"


def with_phases(schedule: Schedule, phases) -> Schedule:
    """`schedule` with the (phase, wall seconds) of the call that made it in its info, where a
    plan file keeps them with the rest of the JSON part of the info."""
    return replace(schedule, info=MappingProxyType(
        {**schedule.info, PHASES_KEY: [[name, float(seconds)] for name, seconds in phases]}))


def phases_of(schedule: Schedule) -> tuple[tuple[str, float], ...]:
    """The (phase, wall seconds) `with_phases` put in `schedule`'s info; () where none."""
    return tuple((name, seconds) for name, seconds in schedule.info.get(PHASES_KEY, ()))


@dataclass(frozen=True)
class SolverSummary:
    strategy: str
    status: str
    objective: float
    """Recompute seconds of the schedule, the quantity minimized."""
    bound: float | None
    gap: float | None
    time: float
    activation_budget: int
    minimized: str = "time"
    """The solver's objective: "time", or "flops" (then `bound` is scaled from the FLOPs bound
    so that `gap` is the FLOPs objective's)."""
    bound_from: str = ""
    """Which proof gave `bound`: CP-SAT's search, or backward steps (relaxation.bound)."""
    model: str = ""
    """The execution model that answered ("single" or "rich", `SolverOptions.model`); under
    "auto" the status, bound and gap are over the rich space."""
    single_status: str = ""
    """Under "auto": the single model's own status (over its smaller space)."""
    time_limit: float | None = None
    """The time limit the solver ran under (seconds; None for a strategy without one)."""
    relative_gap: float | None = None
    """The relative gap at which it could stop (0: it proves optimality or runs to the limit)."""
    limits: str = ""
    """Who chose those two: "chosen by problem size" (`SolverOptions`' defaults, `by_size`) or
    "given" (the caller's options)."""
    deterministic: bool | str | None = None
    """True when the plan came from deterministic mode uncut (the same in any process), a
    sentence when the wall-clock limit cut it, None in wall-clock mode."""
    phases: tuple[tuple[str, float], ...] = ()
    """(phase, wall seconds) of the call that made the plan: capture, profile, lower, (the
    eager mode's) probe, solve (`phases_of`); empty for a schedule solved outside a plan."""
    last_resort: str = ""
    """Why per-block checkpointing came back as a last resort (`info["last_resort"]`: the
    time allowed no better plan that fits), or empty."""
    advice: GapAdvice | None = None
    """Where the plan ends more than GAP_WARN above its bound (or is a last resort): the
    `time_limit=` likely to close the gap (`remat.planner.plans.gap_advice`)."""

    @staticmethod
    def of(schedule: Schedule) -> "SolverSummary":
        single = schedule.info.get("single") or {}
        return SolverSummary(strategy=schedule.strategy, status=schedule.status.value,
                             objective=schedule.cost, bound=schedule.bound, gap=schedule.gap,
                             time=schedule.solve_time, activation_budget=schedule.budget or 0,
                             minimized=schedule.info.get("objective", "time"),
                             bound_from=schedule.info.get("bound_from", ""),
                             model=schedule.info.get("model", ""),
                             single_status=single.get("status", ""),
                             time_limit=schedule.info.get("time_limit"),
                             relative_gap=schedule.info.get("relative_gap"),
                             limits=schedule.info.get("limits", ""),
                             deterministic=schedule.info.get("deterministic"),
                             phases=phases_of(schedule),
                             last_resort=schedule.info.get("last_resort", ""),
                             advice=gap_advice(schedule))

    def to_dict(self) -> dict:
        return {**asdict(self), "phases": [[name, seconds] for name, seconds in self.phases]}


def solver_table(s: SolverSummary) -> str:
    rows = [["strategy", s.strategy], ["status", s.status],
            ["minimized", "recompute time" if s.minimized == "time"
             else "recompute FLOPs (time breaks ties)"],
            ["recompute time", f"{s.objective * 1e3:.4f} ms"],
            ["bound", "n/a" if s.bound is None else f"{s.bound * 1e3:.4f} ms"],
            ["gap", "n/a" if s.gap is None else f"{100 * s.gap:.2f} %"],
            *([["bound from", s.bound_from]] if s.bound_from else []),
            *([["execution model", s.model + (f" (the single model's plan is {s.single_status} "
                                              "in its own space)" if s.single_status else "")]]
              if s.model else []),
            ["solve time", f"{s.time:.2f} s"],
            *([["time by phase", phase_line(s.phases)]] if s.phases else []),
            *([["time limit, relative gap", f"{s.time_limit:g} s, {100 * s.relative_gap:g} %"
                + (f" ({s.limits})" if s.limits else "")]]
              if s.time_limit is not None and s.relative_gap is not None else []),
            *([["repeatable", "yes: deterministic mode, the same plan in any process"
                if s.deterministic is True else f"no: {s.deterministic}"]]
              if s.deterministic is not None else []),
            *([["last resort", f"per-block checkpointing: {s.last_resort}"]]
              if s.last_resort else []),
            *([["gap advice", s.advice.sentence()]] if s.advice is not None else []),
            ["simulated-peak allowance", format_size(s.activation_budget)]]
    return tabulate(rows, disable_numparse=True)


def phase_line(phases: tuple[tuple[str, float], ...]) -> str:
    """"capture 3.1 s, profile 0.4 s, lower 0.2 s, solve 9.8 s (13.5 s in all)"."""
    said = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in phases)
    return f"{said} ({sum(seconds for _, seconds in phases):.1f} s in all)"
