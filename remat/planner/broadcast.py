"""`remat.broadcast_plan`: one rank plans, every rank runs that plan.

Each rank planning for itself can end with ranks running different plans (a solver's time
limit, timings measured per machine). Here rank `src` sends its plan as a plan file's text
(`remat.planner.plans.plan_file`) with `torch.distributed.broadcast_object_list`, and every other
rank loads it onto its own model (`remat.load_plan`: captured again and checked against the
plan's fingerprint, never solved).
"""
from __future__ import annotations

from typing import Any, Callable

from remat.errors import RematError
from remat.planner.plans.plan import Plan
from remat.planner.plans.plan_file import dumps
from remat.planner.load_plan import loads_plan
from remat.planner.job.training import Training

__all__ = ["broadcast_plan"]


def broadcast_plan(plan: Plan | None = None, *, model: Any = None, group: Any = None,
                   src: int = 0, loss_fn: Callable | None = None,
                   training: Training | None = None) -> Plan:
    """Rank `src`'s plan, on every rank of `group`::

        plan = remat.optimize(model, ...) if rank == 0 else None
        plan = remat.broadcast_plan(plan, model=model)
        model = plan.apply(model)          # then fully_shard / DDP, as planned

    Rank `src` (a global rank, as in ``broadcast_object_list``) passes its plan and gets it
    back; every other rank passes None and its `model`, unsharded as it was planned, and gets
    the plan loaded onto it (`loss_fn` and `training` as `load_plan` takes them). A rank whose
    model's step differs from the planned one raises RematError naming the first op that
    differs. Every rank takes part in the broadcast before it raises for a wrong call, so a
    mistake on one rank does not leave the others waiting. With NCCL, set the rank's CUDA
    device first (``torch.cuda.set_device``), as ``broadcast_object_list`` needs."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise RematError("broadcast_plan needs torch.distributed's default process group: call "
                         "torch.distributed.init_process_group first (or plan on each rank "
                         "and save/load it with plan.save and remat.load_plan)")
    rank = dist.get_rank()
    sending = rank == src
    message: list[Any] = [None]
    if sending:
        if not isinstance(plan, Plan):
            message = [{"error": f"rank {src} passed {type(plan).__name__} where its plan "
                                 "belongs"}]
        else:
            try:
                message = [{"plan": dumps(plan)}]
            except RematError as e:
                message = [{"error": str(e)}]
    dist.broadcast_object_list(message, src=src, group=group)
    sent = message[0]
    if "error" in sent:
        raise RematError(f"broadcast_plan: rank {src} sent no plan: {sent['error']}; rank "
                         f"{src} passes the plan remat.optimize made, the others None")
    if sending:
        return plan
    if plan is not None:
        raise RematError(f"broadcast_plan: rank {rank} passed a plan; only rank {src} plans, "
                         "the others pass None and their model")
    if model is None:
        raise RematError(f"broadcast_plan: rank {rank} passed no model to load rank {src}'s "
                         "plan onto: broadcast_plan(None, model=model)")
    return loads_plan(sent["plan"], model, loss_fn=loss_fn, training=training,
                      source=f"rank {src}'s plan")
