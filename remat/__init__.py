"""remat: an automatic activation-checkpointing planner for PyTorch training.

Public names only. The planner imports torch, so it is loaded on first use: `remat.solvers`
stays importable without torch.
"""
from remat.errors import BudgetError, CaptureError, RematError, SolverError

__version__ = "0.1.0"

_LAZY = {
    "optimize": "remat.planner.optimize",
    "Plan": "remat.planner.plans.plan",
    "Training": "remat.planner.job.training",
    "sweep": "remat.planner.sweep",
    "max_batch": "remat.planner.sweep",
    "parse_size": "remat.planner.job.budget",
    "compile_blocks": "remat.planner.plans.block_compile",
    "load_plan": "remat.planner.load_plan",
    "broadcast_plan": "remat.planner.broadcast",
    "for_trainer": "remat.planner.hf",
    "every_expert": "remat.planner.hf",
}

__all__ = ["BudgetError", "CaptureError", "RematError", "SolverError", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'remat' has no attribute {name!r}")
