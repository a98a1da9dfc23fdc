"""The torch-free core: the problem, schedules, the simulator and the strategies.

Floors, each importing only those before it: `core` (the contract: problem, schedule, options,
deadline), `timeline` (the judge of both modes: simulate, overlap, the eager timeline),
`baselines`, `relaxation` (bounds and repairs), `cpsat` (the compiled mode's exact models),
`eager` (the eager mode's planners); `entry` on top holds the two entries, `solve` and
`solve_eager`."""
from remat.solvers.core.options import SolverOptions
from remat.solvers.core.problem import Kind, Op, Phase, Problem, Reason
from remat.solvers.core.schedule import Schedule, Status
from remat.solvers.core.strategy import Strategy
from remat.solvers.entry import STRATEGIES, solve, solve_eager
from remat.solvers.timeline.evaluate import evaluate, make_schedule
from remat.solvers.timeline.simulate import Step, StepKind, Timeline, simulate

__all__ = [
    "Kind", "Op", "Phase", "Problem", "Reason", "STRATEGIES", "Schedule", "SolverOptions",
    "Status", "Step", "StepKind", "Strategy", "Timeline", "evaluate", "make_schedule",
    "simulate", "solve", "solve_eager",
]
