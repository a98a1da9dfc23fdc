"""How the eager models are solved by CP-SAT: the byte unit that keeps the eager model's bytes
exact (`eager_units`), LP-first settings (`lp_first`), and a solve under the deadline's guard
(`solve_model`, `run_model`). Shared by the exact search's stages (`search`), the slot
relaxation (`slots`) and the least-peak search (`least`)."""
from __future__ import annotations

import math
from dataclasses import replace

from ortools.sat.python import cp_model

from remat.errors import SolverError
from remat.solvers.cpsat.search import cp_solver
from remat.solvers.cpsat.units import MAX_UNITS, Units
from remat.solvers.core.deadline import Deadline
from remat.solvers.core.options import SolverOptions
from remat.solvers.core.problem import Problem
from remat.solvers.timeline.eager_blocks import EagerBlocks

# CP-SAT's full-problem workers, first first (the portfolio keeps as many as there are workers).
SUBSOLVERS = ("max_lp", "default_lp", "quick_restart", "core")

def eager_units(problem: Problem, blocks: EagerBlocks, options: SolverOptions) -> Units:
    """The compiled models' units, with checkpoint's generator state (5,056 bytes on a CPU), the
    unread inputs it holds, the Python numbers autograd keeps and the unused tensors eager
    PyTorch makes among the sizes that the byte unit divides, so that the model's bytes stay
    exact."""
    units = Units.of(problem, options)
    extra = [a for a in (blocks.state_bytes, *(n for n, _ in blocks.unread_inputs),
                         *(n for n, _, _ in blocks.kept_numbers),
                         *(n for n, _, _, _ in blocks.unused_tensors)) if a]
    if not units.exact_rounding or all(a % units.byte == 0 for a in extra):
        return units
    unit = math.gcd(units.byte, *extra)
    total = (sum(op.size + op.temp for op in problem.ops)
             + sum(extra) + 2 * blocks.state_bytes * len(blocks.ops))
    if total // unit > MAX_UNITS:
        return units  # sizes round up: conservative, and info["exact"] says so
    return replace(units, byte=unit)


def solve_model(model, options: SolverOptions, deadline: Deadline, seconds: float,
           stage: str):
    solver = lp_first(cp_solver(options, deadline, seconds))
    deadline.limit_solver(solver.parameters, max(seconds, 0.0))
    return run_model(solver, model.model, deadline, stage), solver


def lp_first(solver):
    """The model is 0-1 and linear, and its bound comes from the LP, which needs the links
    "held if cached" that presolve turns into clauses: only linearization level 2 keeps
    them. With 2 to 4 workers the default portfolio runs no such worker (tiny Llama: no
    bound past 41 % of the cost in 10 s; with max_lp first, proven in 0.8 s). So does the
    slot relaxation (Bamba's seventh slot: 19 s to prove without, 1.8 s with)."""
    solver.parameters.linearization_level = 2
    solver.parameters.subsolvers.extend(SUBSOLVERS)
    return solver


def run_model(solver, model: cp_model.CpModel, deadline: Deadline, stage: str):
    with deadline.guard(solver, stage):
        status = solver.Solve(model)
    if status == cp_model.MODEL_INVALID:  # a bug of the model or its hint, never the input's
        raise SolverError(f"eager: CP-SAT refused the model ({model.Validate()}); "
                          "this is a bug: please report it")
    return status
