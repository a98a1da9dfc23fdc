"""FSDP2 inside pipeline stages (PP x FSDP2, and with DTensor stages PP x TP x FSDP2): what a
rank holds besides its micro-batches' activations, as torch 2.13's pipelining runtime drives
`fully_shard` (read in torch/distributed/pipelining/stage.py and fsdp/_fully_shard).

The job this models: each block of a stage and the stage itself `fully_shard`-ed over the
data-parallel mesh with ``reshard_after_forward=False`` (torchtitan's choice under a pipeline:
parameters gathered once a step, not once a micro-batch), planned with
``Training(data_parallel=dp, zero_stage=3, reshard_after_forward=False)``. Then:
- every micro-batch's backward runs with ``set_requires_gradient_sync(False)`` and
  ``set_reshard_after_backward(False)`` (`backward_maybe_with_nosync`): the unsharded
  gradients accumulate in `.grad` as without FSDP, and the gathered parameters stay;
- so a micro-batch's passes are those of the unsharded stage (planned with
  `unsharded_training`), and the rank holds, besides its shards (the state), each unit's
  gathered parameters from its first forward to the end of the step (`gathered`);
- after the last backward (the REDUCE_GRAD action, `perform_reduce_grad`) each unit's
  post-backward runs, the stage's root unit first and then the blocks in order: it reshards
  the unit's parameters, frees the previous unit's reduce-scatter buffer, copies the unit's
  gradients into a new one (their bytes, each parameter padded to a multiple of dp rows) and
  reduce-scatters it into the shard (1/dp of it) while the unsharded gradients still live
  (remat.fx_passes.lowering.sharding's order, measured there). `reduce_peak` is that phase's
  peak, which the plan puts at the rank's last action.
Units are the stage's repeated blocks (`remat.solvers.core.blocks.block_of` of the parameter
names, as for FSDP2 without a pipeline) and the rest of the stage (its root).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Sequence

from remat.errors import RematError
from remat.planner.job.training import Training, named_shapes

__all__ = ["StageUnits", "check_fsdp_in_pipeline", "reduce_peak", "stage_units",
           "unsharded_training"]


@dataclass(frozen=True)
class StageUnits:
    """A stage's FSDP units in the order their post-backwards run (root first): the bytes of
    each one's gathered parameters (this rank's TP shards, whole over dp), of its gradients,
    and of its reduce-scatter buffer (gradients padded to dp rows per parameter)."""

    params: tuple[int, ...]
    grads: tuple[int, ...]
    padded: tuple[int, ...]

    @property
    def gathered(self) -> int:
        return sum(self.params)


def sharded_in_pipeline(training: Training) -> bool:
    return training.data_parallel > 1 and training.zero_stage > 0


def check_fsdp_in_pipeline(training: Training, split_backward: bool) -> None:
    """Refuse what this model does not cover, saying what is."""
    if not sharded_in_pipeline(training):
        return
    if training.zero_stage != 3 or training.reshard_after_forward:
        raise RematError(
            f"plan_pipeline with Training(zero_stage={training.zero_stage}, "
            f"reshard_after_forward={training.reshard_after_forward}): sharded data "
            "parallelism inside pipeline stages is planned for FSDP2 with "
            "fully_shard(reshard_after_forward=False) on each block and on the stage "
            "(torchtitan's setting under a pipeline): Training(data_parallel=dp, zero_stage=3, "
            "reshard_after_forward=False)")
    if split_backward:
        raise RematError("plan_pipeline: FSDP2 inside stages of a schedule that splits the "
                         "backward (zero-bubble) is not modelled; use GPipe, 1F1B or an "
                         "interleaved schedule with whole backwards, or no FSDP2 in the stages")


def unsharded_training(training: Training) -> Training:
    """The training a micro-batch's passes are planned with: no sharding (module doc)."""
    if not sharded_in_pipeline(training):
        return training
    return replace(training, data_parallel=1, zero_stage=0)


def stage_units(stage: Any, training: Training) -> StageUnits:
    from remat.solvers.core.blocks import block_of

    dp = training.data_parallel
    units: dict[str, list[int]] = {"": [0, 0, 0]}  # the root first, then blocks in order
    for name, shape, p in named_shapes(stage):
        unit = units.setdefault(block_of(name.rsplit(".", 1)[0]) or "", [0, 0, 0])
        n = math.prod(shape)
        unit[0] += n * training.weight_bytes
        if not training.is_frozen(name, p):
            rows = shape[0] if shape else 1
            padded = -(-rows // dp) * dp * (n // rows if rows else 0)
            unit[1] += n * training.grad_bytes
            unit[2] += padded * training.grad_bytes
    values = [v for v in units.values() if v[0]]
    return StageUnits(*(tuple(v[i] for v in values) for i in range(3)))


def reduce_peak(units: Sequence[StageUnits], data_parallel: int) -> int:
    """The most the rank's end-of-step reduction holds above the state (module doc), the
    stages' units in order."""
    params = sum(u.gathered for u in units)
    grads = sum(sum(u.grads) for u in units)
    shards = peak = 0
    for u in units:
        for p, g, padded in zip(u.params, u.grads, u.padded):
            params -= p  # reshard
            peak = max(peak, params + grads + shards + padded + padded // data_parallel)
            grads -= g
            shards += padded // data_parallel
    return peak


def with_fsdp(memory: Any, units: Sequence[StageUnits], data_parallel: int, kept: Sequence[Any]):
    """The rank's `RankMemory` with its stages' FSDP2 terms: every action holds the gathered
    parameters (from the first forward on: counted from the step's start, an overestimate of
    the first forward's gathers only), and the last one, after which REDUCE_GRAD runs, at
    least the reduction's peak with what the runtime keeps to the step's end."""
    if not units:
        return memory
    gathered = sum(u.gathered for u in units)
    peaks = [p + gathered for p in memory.peaks]
    end = sum(k.size for k in kept if k.until is None)
    if peaks:
        peaks[-1] = max(peaks[-1], reduce_peak(units, data_parallel) + end)
    return replace(memory, peaks=tuple(peaks))
