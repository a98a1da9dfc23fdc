"""What the job a plan is made in changes in how it is planned.

In a distributed job every rank that plans for itself must come out with the same plan (they
run one step together: a rank that recomputes other values than its peers holds other bytes,
and under FSDP2 or tensor parallelism their collectives must still pair up). The solver's
wall-clock mode is not repeatable (its stages share the time actually left, its workers race),
so there the solver plans on deterministic time unless the caller chose
(`SolverOptions(deterministic=False)`); `remat.broadcast_plan` is the other way, one plan made
on rank 0 and sent."""
from __future__ import annotations

from dataclasses import replace

from remat.solvers import SolverOptions

__all__ = ["distributed_ranks", "options_for_this_job"]


def distributed_ranks() -> int:
    """The ranks of the default process group, or 1 outside a distributed job."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size()


def options_for_this_job(options: SolverOptions | None) -> SolverOptions:
    """`options` (or the defaults) with `deterministic` decided where the caller left it None:
    True in a job of several ranks, else False."""
    options = options or SolverOptions()
    if options.deterministic is not None:
        return options
    return replace(options, deterministic=distributed_ranks() > 1)
