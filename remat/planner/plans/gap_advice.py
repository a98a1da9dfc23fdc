"""What to do about a plan that ends far from its bound: a `time_limit=` likely to close the gap.

A time-limited solve (the exact solver, the eager search) returns its best plan when its limit
passes, with the gap between its cost and the proven bound. Above GAP_WARN the report says so
and suggests a limit, and `remat.optimize` warns. Torch-free.

How the limit is estimated (`suggest`): from the compiled solver's anytime trace
(`info["trace"]`: every improving plan's cost and the bound at that moment) and the final gap,
the gap's decay is fitted as a power of the time, gap(t) = g1 * (t / t1) ** -a, through the
first improving plan and the end of the solve, and solved for the time at which the gap reaches
GAP_WARN. The search's gap falls roughly so between improvements on the solver's problems, but
the bound moves in jumps: the figure is an estimate, never a promise, and it is kept between
LEAST_FACTOR and MOST_FACTOR times the limit the solve had. With no decay to fit (the eager
search, which keeps no trace; a single improving plan; per-block checkpointing returned as a
last resort, where no search ran to its end), the suggestion is FALLBACK_FACTOR times that limit,
and says it is a guess.
"""
from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass

from remat.solvers import Schedule

__all__ = ["GAP_WARN", "GapAdvice", "gap_advice", "warn_on_gap"]

# A plan more than this fraction above its bound is reported with a suggested limit.
GAP_WARN = 0.02
# The suggestion is at least this many times the limit the solve had: a smaller step rarely
# changes the outcome on a machine whose load varies by more.
LEAST_FACTOR = 2.0
# And at most this many: beyond it the fitted decay is too slow to extrapolate from.
MOST_FACTOR = 20.0
# Without a decay to fit, a guess, which the advice says is one: four times the limit.
FALLBACK_FACTOR = 4.0


@dataclass(frozen=True)
class GapAdvice:
    """A plan's gap above GAP_WARN (None: no bound, per-block checkpointing as a last resort),
    the limit its solve ran under, and the suggested `time_limit=` with how it was estimated."""

    gap: float | None
    time_limit: float
    suggested: float
    how: str

    def sentence(self) -> str:
        said = ("no bound was proven" if self.gap is None
                else f"the plan is {100 * self.gap:.1f} % above its bound")
        return (f"{said} after a {self.time_limit:.3g} s time limit: "
                f"SolverOptions(time_limit={self.suggested:g}) would likely bring it within "
                f"{100 * GAP_WARN:g} % ({self.how})")

    def to_dict(self) -> dict:
        return asdict(self)


def gap_advice(schedule: Schedule) -> GapAdvice | None:
    """The advice for `schedule`, or None where there is none to give: a strategy without a
    time limit, or a plan within GAP_WARN of its bound (and not a last resort)."""
    limit = schedule.info.get("time_limit")
    resort = schedule.info.get("last_resort")
    if limit is None or not limit > 0:
        return None
    if not resort and (schedule.gap is None or schedule.gap <= GAP_WARN):
        return None
    suggested, how = suggest(schedule, float(limit), bool(resort))
    return GapAdvice(gap=schedule.gap, time_limit=float(limit), suggested=suggested, how=how)


def suggest(schedule: Schedule, limit: float, resort: bool) -> tuple[float, str]:
    """(seconds, how they were estimated) for a solve of `limit` seconds (module docstring)."""
    fitted = None if resort else _decay(schedule)
    if fitted is None:
        why = ("per-block checkpointing came back as a last resort" if resort
               else "no decay of the gap to extrapolate from")
        return _rounded(FALLBACK_FACTOR * limit), (
            f"a guess, {FALLBACK_FACTOR:g} times the limit: {why}")
    (t0, g0), (t1, g1), power = fitted
    # In logarithms: a decay near flat puts the fit's time past any float.
    log_wanted = math.log(t1) + math.log(g1 / GAP_WARN) / power
    low, high = LEAST_FACTOR * limit, MOST_FACTOR * limit
    wanted = math.exp(min(log_wanted, math.log(high) + 1.0))
    kept = min(max(wanted, low), high)
    how = (f"the gap fell from {100 * g0:.1f} % at {t0:.2g} s to {100 * g1:.1f} % at "
           f"{t1:.2g} s; extrapolated as a power of the time")
    if wanted > high:
        how += f", capped at {MOST_FACTOR:g} times the limit (the fit said more)"
    return _rounded(kept), how


def _decay(schedule: Schedule):
    """((t0, g0), (t1, g1), power) of the gap's fall from the first improving plan of the
    anytime trace to the end of the solve, or None where it did not fall."""
    if schedule.gap is None or not schedule.gap > 0 or not schedule.solve_time > 0:
        return None
    points = [(entry["time"], (entry["cost"] - entry["bound"]) / entry["cost"])
              for entry in schedule.info.get("trace") or ()
              if entry["time"] > 0 and entry["cost"] > 0]
    if not points:
        return None
    t0, g0 = points[0]
    t1, g1 = schedule.solve_time, schedule.gap
    if not (t1 > t0 and g0 > g1 > 0):
        return None
    return (t0, g0), (t1, g1), math.log(g0 / g1) / math.log(t1 / t0)


def _rounded(seconds: float) -> float:
    """Up to two significant figures: 47.3 -> 48, 123 -> 130."""
    if seconds <= 0:
        return 1.0
    step = 10.0 ** (math.floor(math.log10(seconds)) - 1)
    return float(math.ceil(seconds / step - 1e-9) * step)


def warn_on_gap(schedule: Schedule, log: logging.Logger) -> GapAdvice | None:
    """Log the advice for `schedule` as a warning, if any; return it."""
    advice = gap_advice(schedule)
    if advice is not None:
        resort = schedule.info.get("last_resort")
        log.warning("remat: %s%s", advice.sentence(),
                    f"; per-block checkpointing was returned as a last resort: {resort}"
                    if resort else "")
    return advice
