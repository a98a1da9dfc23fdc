"""Injected clocks for the solver's deadlines (`SolverOptions(clock=...)`): a test's verdict
never depends on how much CPU the solver got."""
from __future__ import annotations


class NoTime:
    """A clock 1,000 s later at every read: no stage of a call ever finds time left."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1000.0
        return self.now


__all__ = ["NoTime"]
