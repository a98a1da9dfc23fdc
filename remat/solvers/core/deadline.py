"""One deadline for a whole solver call, passed down to every stage that may take time.

A stage asks it how much time is left (`left`, `share`), checks it between steps (`check`,
`expired`) and stops when it is spent; a stage that stops records where and why (`stopped`), so
the result can say it and tests can assert it. A part of the call gets a sub-deadline
(`within`) that never ends after its parent's and records into the same place.

The clock is injectable: tests give a fake one (or CPU time) and assert which stages ran and
where the call stopped, never wall time. CP-SAT has its own timer: `limit_solver` sets a
solver's time limit from the deadline, and `guard` stops its search from a watchdog thread once the
deadline passes (CP-SAT's own limit is checked between its steps; a large presolve step under
load ran seconds past it).

Deterministic mode (`deterministic=True`) plans on a clock that does not depend on the machine's
speed or load: CP-SAT's deterministic time (`max_deterministic_time`, read back after each solve)
and the modelled cost of the Python work the stages report (`charge`). Every decision that reads
`now`, `left` or `share` then comes out the same in any process. The wall clock still bounds the
call (`wall_left`, `expired`): when it is what stopped a stage, `cut` names the stage, and the
result is no longer reproducible.
"""
from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator

__all__ = ["Clock", "Deadline", "OutOfTime", "modelled", "ticker"]

Clock = Callable[[], float]

# How often the watchdog of `guard` looks at the clock.
WATCH_SECONDS = 0.02
# Deterministic mode: a part's time left follows the wall clock (and the call is marked cut)
# once the wall clock's share is behind the plan by more than this share of the planned limit.
SLOWER_MARGIN = 0.25


class OutOfTime(Exception):
    """Raised inside a stage (a model's construction, a baseline's prefix search) that cannot
    finish before its deadline; the stage's caller catches it and goes on without it."""

    def __init__(self, stage: str):
        super().__init__(f"{stage}: out of time")
        self.stage = stage


class _Record:
    """What the stages of one call did with its time, shared by a deadline and its parts."""

    def __init__(self) -> None:
        self.stages: list[tuple[str, float]] = []  # (stage, elapsed) as entered
        self.stopped: tuple[str, str] | None = None  # the first stage that ran out: (stage, why)
        self.cut: str | None = None  # deterministic mode: the stage the wall clock cut


class Deadline:
    """`seconds` from now on `clock`; in deterministic mode, planned on deterministic time."""

    def __init__(self, seconds: float, *, clock: Clock = time.perf_counter,
                 deterministic: bool = False, planned: float | None = None,
                 _parent: "Deadline | None" = None, _end: float | None = None,
                 _wall_end: float | None = None):
        """`seconds` of wall clock from now; `planned`: the seconds the stages plan with (in
        deterministic mode, deterministic seconds; default `seconds`)."""
        if not seconds >= 0:
            raise ValueError(f"a deadline needs a non-negative number of seconds, not {seconds!r}")
        self.clock, self.deterministic = clock, deterministic
        self.limit = seconds if planned is None else planned
        if _parent is None:
            self.root, self.record = self, _Record()
            self.virtual = 0.0  # deterministic mode: the deterministic seconds spent so far
            self.wall_start = clock()
            self.wall_end = self.wall_start + seconds
            self.wall_ratio = seconds / self.limit if self.limit > 0 else 1.0
            self.start = self.now()
            self.end = self.start + self.limit
        else:
            self.root, self.record = _parent.root, _parent.record
            self.wall_start = _parent.wall_start
            self.wall_end = min(_parent.wall_end, _wall_end if _wall_end is not None
                                else _parent.wall_end)
            self.start = _parent.now()
            self.end = min(_end if _end is not None else self.start + self.limit, _parent.end)

    # --- Reading it.

    def now(self) -> float:
        """The planning clock: the wall clock, or in deterministic mode the deterministic
        seconds spent since the call began (plus the wall clock's start, so that both read
        alike)."""
        if self.deterministic:
            return self.wall_start + self.root.virtual
        return self.clock()

    def elapsed(self) -> float:
        """Seconds since the whole call began, on the planning clock."""
        return self.now() - self.root.start

    def left(self) -> float:
        """Seconds left, never negative: on the planning clock, and in deterministic mode on
        this part's share of the wall clock too when that is less (a machine slower than the
        plan: the stages then adapt as on the wall clock, and the call is marked cut)."""
        planned = self.end - self.now()
        if self.deterministic:
            wall = (self.wall_end - self.clock()) / self.root.wall_ratio
            # A margin for the work counted only once it is done (a stage's evaluations).
            if wall < planned - SLOWER_MARGIN * self.root.limit:
                self._cut()
                planned = wall
        return max(0.0, planned)

    def wall_left(self) -> float:
        """Seconds left on `clock` before the call's hard end, never negative."""
        return max(0.0, self.wall_end - self.clock())

    def share(self, fraction: float) -> float:
        """`fraction` of this deadline's limit, or what is left if that is less."""
        return min(fraction * self.limit, self.left())

    def expired(self) -> bool:
        """Whether the time is spent: planned (`left`) or, whatever the mode, the wall clock's.
        In deterministic mode a wall-clock expiry marks the call as cut."""
        if self.end - self.now() <= 0:
            return True
        if self.wall_end - self.clock() <= 0:
            if self.deterministic:
                self._cut()
            return True
        return False

    def _cut(self) -> None:
        """Deterministic mode: the wall clock decided something; name the stage it did in."""
        if self.record.cut is None:
            self.record.cut = self.record.stages[-1][0] if self.record.stages else "start"

    # --- Parts and stages.

    def within(self, seconds: float) -> "Deadline":
        """A part of this call: `seconds` from now (planning clock), never past this deadline's
        end; in deterministic mode its share of the wall clock ends in proportion."""
        seconds = max(0.0, seconds)
        return Deadline(0.0, clock=self.clock, deterministic=self.deterministic,
                        planned=seconds, _parent=self,
                        _wall_end=self._wall_after(seconds))

    def until(self, end: float) -> "Deadline":
        """A part of this call that ends at `end` on the planning clock (or this one's end)."""
        seconds = max(0.0, end - self.now())
        return Deadline(0.0, clock=self.clock, deterministic=self.deterministic,
                        planned=seconds, _parent=self, _end=end,
                        _wall_end=self._wall_after(seconds))

    def _wall_after(self, seconds: float) -> float | None:
        """Deterministic mode: the wall-clock end of a part of `seconds` planned seconds, the
        same share of the wall clock (`wall_ratio`: the limit over the planned seconds)."""
        if not self.deterministic:
            return None
        return self.clock() + seconds * self.root.wall_ratio

    def reserving(self, seconds: float) -> "Deadline":
        """This deadline less `seconds` kept at its end for the caller to turn the stages'
        answer into a result: on the wall clock, and on the planning clock unless it is
        deterministic (whose plan ends well before the wall clock's end anyway)."""
        seconds = max(0.0, seconds)
        end = self.end if self.deterministic else self.end - seconds
        return Deadline(0.0, clock=self.clock, deterministic=self.deterministic,
                        planned=max(0.0, end - self.now()), _parent=self, _end=end,
                        _wall_end=self.wall_end - seconds)

    def enter(self, stage: str) -> None:
        self.record.stages.append((stage, round(self.elapsed(), 3)))

    def check(self, stage: str) -> bool:
        """True while time is left; else records that `stage` found none (the first such
        stage is `stopped`) and returns False."""
        if not self.expired():
            return True
        self.stop(stage, "no time left")
        return False

    def raise_if_expired(self, stage: str) -> None:
        """For loops that cannot return a partial result: OutOfTime once the time is spent."""
        if self.expired():
            self.stop(stage, "no time left")
            raise OutOfTime(stage)

    def stop(self, stage: str, why: str) -> None:
        if self.record.stopped is None:
            self.record.stopped = (stage, why)

    @property
    def stages(self) -> tuple[tuple[str, float], ...]:
        return tuple(self.record.stages)

    @property
    def stopped(self) -> tuple[str, str] | None:
        return self.record.stopped

    @property
    def cut(self) -> str | None:
        return self.record.cut

    # --- Deterministic time.

    def charge(self, seconds: float) -> None:
        """Deterministic mode: count `seconds` of modelled work (a Python stage's, predicted
        from the problem's size, not measured). A no-op on the wall clock."""
        if self.deterministic:
            self.root.virtual += max(0.0, seconds)

    # --- CP-SAT.

    def limit_solver(self, parameters, seconds: float | None = None,
                     weight: float = 1.0) -> None:
        """Set a CP-SAT solver's limits: `seconds` (default: what is left) on the planning
        clock, never past the wall clock's end. Deterministic mode limits the deterministic
        time, `weight` seconds a deterministic second of this kind of model (`DTIME_WEIGHT`),
        and leaves the wall-clock limit as the safety net (the caller makes the search itself
        deterministic: one worker, or the interleaved search)."""
        planned = self.left() if seconds is None else max(0.0, min(seconds, self.left()))
        if self.deterministic:
            parameters.max_deterministic_time = max(planned / weight, 1e-3)
            parameters.max_time_in_seconds = max(self.wall_left(), 1e-3)
        else:
            parameters.max_time_in_seconds = max(min(planned, self.wall_left()), 1e-3)

    @contextmanager
    def guard(self, solver, stage: str = "CP-SAT", weight: float = 1.0) -> Iterator[None]:
        """Run a CP-SAT solve inside this: a watchdog stops its search once the deadline
        passes, presolve included; in deterministic mode the deterministic time the solve
        spent, times `weight`, is counted afterwards."""
        done = threading.Event()

        def watch() -> None:
            while not done.wait(WATCH_SECONDS):
                if self.wall_end - self.clock() <= 0 or (
                        not self.deterministic and self.end - self.clock() <= 0):
                    solver.StopSearch()
                    self.stop(stage, "stopped at the deadline")
                    return

        watchdog = threading.Thread(target=watch, name="remat-deadline", daemon=True)
        watchdog.start()
        try:
            yield
        finally:
            done.set()
            watchdog.join()
            if self.deterministic:
                self.root.virtual += weight * solver.response_proto.deterministic_time
                if self.wall_end - self.clock() <= 0 and self.record.cut is None:
                    self.record.cut = stage


# A loop's ticker looks at the clock once in this many calls (a clock read costs about as much as
# a constraint added: 60 ns).
TICK_EVERY = 64


def ticker(deadline: Deadline | None, stage: str) -> Callable[[], None]:
    """A function for a long loop that cannot return a partial result (a model's
    construction) to call each turn: OutOfTime once `deadline` passes (never, when None)."""
    if deadline is None:
        return lambda: None
    turns = 0

    def tick() -> None:
        nonlocal turns
        turns += 1
        if turns % TICK_EVERY == 0:
            deadline.raise_if_expired(stage)
    return tick


# Modelled seconds per op of the problem of the Python work that deterministic mode charges
# (`modelled`): about what each took in CPU seconds here, rounded up (an evaluation,
# make_schedule and simulate, 4 to 40 us an op; a relaxation's step 4 to 7 us to build; the
# single model 60 to 200 us, the rich one 500 to 1,500 us).
WORK_PER_OP = {"evaluation": 1e-5, "relaxation step": 1e-5, "model": 2.5e-4, "rich model": 1.5e-3}
# CPU seconds a CP-SAT deterministic second takes, by kind of model, which deterministic mode
# charges (`guard`, `limit_solver`'s `weight`): measured here on one worker, the single model's
# least-cost search 4 to 10 (its least-peak stage 5 to 30), the relaxations 2 to 4.
DTIME_WEIGHT = {"model": 10.0, "relaxation": 4.0}


def modelled(work: str, ops: int) -> float:
    """The modelled seconds of `work` (a key of WORK_PER_OP) on a problem of `ops` ops."""
    return WORK_PER_OP[work] * ops
