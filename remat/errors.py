"""The errors remat raises. Torch-free, so that `remat.solvers` can raise them too.

Every error says what went wrong and what to do about it; none is ever returned as a value.
"""
from __future__ import annotations


class RematError(Exception):
    """Base class of every error remat raises on purpose."""


class BudgetError(RematError):
    """No schedule fits the budget.

    `smallest` is the smallest budget (in the same terms as `budget`) that the strategy that
    raised can meet; for the exact strategies it is the smallest that any schedule can meet.
    `dominant` names the largest term of the memory where the caller knows it, and `remedy`
    what acts on that term. `schedule` is the schedule of that smallest peak, where the
    strategy found one (the exact solver does). `proven`: whether `smallest` is proven the
    least the strategy reaches (True), or only the least found in the time it had, a budget
    that fits which more time may lower (False); None where the raiser does not say (a
    baseline's smallest is its own plan's, exactly).
    """

    def __init__(self, message: str, *, budget: int, smallest: int | None,
                 dominant: str | None = None, remedy: str | None = None, schedule=None,
                 proven: bool | None = None):
        super().__init__(message)
        self.schedule = schedule
        self.budget = budget
        self.smallest = smallest
        self.dominant = dominant
        self.remedy = remedy
        self.proven = proven


class CaptureError(RematError):
    """The model cannot be captured as one training graph; the message names the graph break."""


class SolverError(RematError):
    """A solver stopped without any schedule (time limit, or an internal failure)."""
