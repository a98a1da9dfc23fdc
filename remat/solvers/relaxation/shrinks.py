"""How far `remat.solvers.relaxation.relaxed`'s turns shrink the rooms of the relaxation below
the budget's: a little past each plan's excess until one fits, then bisected between the shrinks
that fit and not, since a smaller shrink is a cheaper plan."""
from __future__ import annotations

__all__ = ["OVERSHOOT", "PRECISION", "Shrinks"]

# Rooms shrink by this many times a plan's excess until one fits, then bisect to this
# precision (a share of the budget).
OVERSHOOT = 1.2
PRECISION = 1e-3


class Shrinks:
    """The shrink of the next turn (`shrink`), from what the turns so far found; bisected to
    PRECISION of the budget (bytes: 1 at least)."""

    def __init__(self, budget: int):
        self.shrink = 0
        self.ceiling: int | None = None  # the least shrink found infeasible
        self.fits: int | None = None  # the last shrink whose plan fit
        self.fails: int | None = None  # the last shrink whose plan did not
        self.precision = max(1, PRECISION * budget)

    def after_infeasible(self) -> bool:
        """Shrunk past what some step can hold: bisect below (bert at half its save-all peak,
        where the overshoot passed the only shrinks whose plans fit). False: nothing left to
        bisect."""
        self.ceiling, low = self.shrink, self.fails or 0
        if self.ceiling - low <= self.precision:
            return False
        self.shrink = (low + self.ceiling) // 2
        return True

    def after_plan(self, excess: int) -> bool:
        """The next shrink after a plan `excess` bytes over the budget (at most 0: it fit, and
        `fits` says so); False: nothing left to bisect."""
        if self.fits is None:  # a little past the excess, so that the next plan likely fits
            self.shrink += int(OVERSHOOT * excess)
            if self.ceiling is not None and self.shrink >= self.ceiling:  # bisect below it
                if self.ceiling - self.fails <= self.precision:
                    return False
                self.shrink = (self.fails + self.ceiling) // 2
        elif self.fails is None or self.fits - self.fails <= self.precision:
            return False
        else:  # bisect: a smaller shrink is cheaper
            self.shrink = (self.fits + self.fails) // 2
        return True
