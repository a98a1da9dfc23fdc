"""The torch-free core: the problem, schedules, the simulator and the strategies."""
from remat.solvers.options import SolverOptions
from remat.solvers.problem import Kind, Op, Phase, Problem, Reason
from remat.solvers.registry import STRATEGIES, Strategy, solve
from remat.solvers.schedule import Schedule, Status, evaluate, make_schedule
from remat.solvers.simulate import Step, StepKind, Timeline, simulate

__all__ = [
    "Kind", "Op", "Phase", "Problem", "Reason", "STRATEGIES", "Schedule", "SolverOptions",
    "Status", "Step", "StepKind", "Strategy", "Timeline", "evaluate", "make_schedule",
    "simulate", "solve",
]
