"""The least-peak descent: plans of ever lower peak, each asked for at a budget a step below the
best found so far, made by the repair (recompute more where the plan peaks) or, where that finds
none, read off the relaxation at that budget. The step halves when neither finds a plan below
the best, down to LAST_STEP.

Why: CP-SAT minimizing the peak is a max over every step, a flat objective its neighbourhood
search improves on rarely. On a transformers Qwen2 (4 layers, hidden 256, seq 256, batch 4;
just-in-time positions, `time_limit=60`, deterministic mode) the least-peak search named
per-block checkpointing's 49.41 MiB before the descent and 41.66 MiB with it; on a ViT (6
layers, hidden 192, batch 8) 32.98 and 31.23 MiB (`benchmarks/least_peak.py --deterministic`,
the figures before from the same problems solved without the descent). The descent's plans,
not the model's search, carry the least peak CP-SAT then starts from.
"""
from __future__ import annotations

import logging
import math

from remat.solvers.core.deadline import Deadline, OutOfTime
from remat.solvers.core.problem import Problem
from remat.solvers.core.schedule import Schedule
from remat.solvers.relaxation.relaxed import relaxed_schedule
from remat.solvers.relaxation.repair import repair

__all__ = ["descend"]

logger = logging.getLogger(__name__)

# The first step below the best peak, as a share of it, and the last one tried: each failure
# halves it (0.02 to 5e-4: six failures end a descent).
FIRST_STEP = 0.02
LAST_STEP = 5e-4
# A move (a repair, a relaxation's read) at one budget gets this share of the whole call's time
# limit (a relaxation's read took 0.5 to 2 s on the Qwen2 and the ViT above). A share of the call's
# limit, not of the time left: the repair's trim and the relaxation's joined steps depend on
# their time, and a call asked for a budget that an earlier one named then makes the same
# plans.
MOVE_SHARE = 0.05


def descend(problem: Problem, start: Schedule, deadline: Deadline,
            target: int = -1) -> Schedule:
    """The plan of least peak found from `start` before `deadline`: `start` itself where no
    step finds lower. Stops early once a plan peaks at `target` bytes or less. The same
    `start` and call limit (`deadline.root.limit`) give the same plans in the same order
    wherever the relaxation's solves end alike (deterministic mode), whatever `target`."""
    best, step = start, FIRST_STEP
    while step >= LAST_STEP and best.peak > target and deadline.check("descending the peak"):
        budget = math.floor(best.peak * (1 - step))
        try:
            found = _below(problem, best, budget, deadline)
        except OutOfTime:
            break
        if found is not None and found.peak < best.peak:
            logger.debug("descent at %d: %d (cost %.6g)", budget, found.peak, found.cost)
            best = found
        else:
            logger.debug("descent at %d: none below %d", budget, best.peak)
            step /= 2
    return best


def _below(problem: Problem, best: Schedule, budget: int,
           deadline: Deadline) -> Schedule | None:
    """A plan within `budget` (below `best`'s peak): `best` repaired, else the relaxation's at
    that budget (None: neither found one)."""
    move = MOVE_SHARE * deadline.root.limit
    repaired = repair(problem, best, budget, deadline.within(move))
    if repaired is not None and repaired.peak <= budget:
        return repaired
    read, _ = relaxed_schedule(problem, budget, time_limit=move, deadline=deadline)
    return read if read is not None and read.peak <= budget else None
