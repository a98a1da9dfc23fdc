"""What tensor parallelism a model is parallelized with, read off the model itself, and its check
against `Training(tensor_parallel=..., sequence_parallel=...)`.

The degree is the size of the device mesh the model's DTensor parameters live on
(`parallelize_module` puts them on the TP mesh); sequence parallelism is the presence of
`SequenceParallel` styles, found through the forward pre-hook `parallelize_module` registers
for each (`distribute_module` wraps the style's `_prepare_input_fn`). Nothing is guessed from
module names: a model without DTensor parameters is not tensor-parallel, whatever it is
called, and planning it as if it were is refused (`check_tensor_parallel`).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from remat.errors import RematError

__all__ = ["TensorLayout", "check_tensor_parallel", "tensor_layout"]

PARALLELIZE_FIRST = (
    "parallelize it first with torch.distributed.tensor.parallel.parallelize_module on the "
    "job's TP mesh (or, to plan without a job, on remat.planner.parallel.tensor_parallel."
    "fake_tensor_parallel({size}): `with fake_tensor_parallel({size}) as mesh: "
    "parallelize_module(model, mesh, plan)`) and plan the parallelized model with "
    "execution=\"eager\"")


@dataclass(frozen=True)
class TensorLayout:
    """The tensor parallelism of a model: `size` TP ranks (1: no DTensor parameter), whether
    SequenceParallel styles are applied, and each DTensor parameter's placements."""

    size: int
    sequence_parallel: bool
    placements: dict[str, str]

    @property
    def parallel(self) -> bool:
        return bool(self.placements)


def tensor_layout(model: Any) -> TensorLayout:
    """The model's tensor parallelism (module doc). Raises RematError when its DTensor
    parameters lie on more than one mesh or on a mesh of more than one dimension (a model
    already `fully_shard`-ed over a 2-D mesh: plan it before `fully_shard`)."""
    _refuse_fully_sharded(model)
    meshes: list = []  # the distinct meshes (equal meshes are often distinct objects)
    placements = {}
    for name, p in model.named_parameters():
        mesh = getattr(p, "device_mesh", None)
        if mesh is None or not hasattr(p, "placements"):
            continue
        if not any(mesh == m for m in meshes):
            meshes.append(mesh)
        placements[name] = str(p.placements)
    if not placements:
        return TensorLayout(1, _sequence_parallel(model), {})
    if len(meshes) > 1 or any(m.ndim != 1 for m in meshes):
        shapes = sorted({tuple(m.shape) for m in meshes})
        raise RematError(
            f"the model's DTensor parameters lie on meshes of shapes {shapes}; remat plans a "
            "model tensor-parallelized over one 1-D mesh (its TP dimension): plan it after "
            "parallelize_module and before fully_shard (FSDP2 x TP: "
            "Training(data_parallel=..., zero_stage=3) plans FSDP2 over the TP shards), then "
            "apply the plan to the parallelized blocks and fully_shard them")
    (mesh,) = meshes
    return TensorLayout(mesh.size(), _sequence_parallel(model), placements)


def _refuse_fully_sharded(model: Any) -> None:
    """FSDP2's parameters are DTensors too, sharded over the data-parallel mesh: they are not
    tensor parallelism, and remat plans a model before `fully_shard`."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without distributed
        return
    if any(isinstance(m, FSDPModule) for m in model.modules()):
        raise RematError(
            "the model is already fully_shard-ed (FSDP2): remat plans it before fully_shard, "
            "with the sharding stated in Training(data_parallel=..., zero_stage=3) (and, for "
            "FSDP2 x TP, after parallelize_module); apply the plan to the blocks, then call "
            "fully_shard")


def _sequence_parallel(model: Any) -> bool:
    try:
        from torch.distributed.tensor.parallel import SequenceParallel
    except ImportError:  # pragma: no cover - torch without distributed
        return False
    prepare = SequenceParallel._prepare_input_fn
    for module in model.modules():
        for hook in getattr(module, "_forward_pre_hooks", {}).values():
            for cell in getattr(hook, "__closure__", None) or ():
                try:
                    held = cell.cell_contents
                except ValueError:  # an empty cell
                    continue
                if isinstance(held, functools.partial) and held.func is prepare:
                    return True
    return False


def check_tensor_parallel(model: Any, training: Any) -> TensorLayout:
    """The model's layout, checked against what `training` states: `tensor_parallel` (None:
    as the model is parallelized) must be the TP mesh's size, `sequence_parallel` (None:
    as the model is) whether SequenceParallel styles are applied. A model without DTensor
    parameters with `tensor_parallel > 1` is refused with the remedy."""
    layout = tensor_layout(model)
    stated = getattr(training, "tensor_parallel", None)
    if stated is not None and stated > 1 and not layout.parallel:
        raise RematError(
            f"Training(tensor_parallel={stated}): the model has no DTensor parameter, so it is "
            "not tensor-parallel and remat will not guess its sharding; "
            + PARALLELIZE_FIRST.format(size=stated))
    if stated is not None and layout.parallel and stated != layout.size:
        raise RematError(
            f"Training(tensor_parallel={stated}), but the model is parallelized over a mesh of "
            f"{layout.size} ranks: state tensor_parallel={layout.size} (or leave it None, as "
            "the model is), or parallelize the model on a mesh of the job's TP size")
    sequence = getattr(training, "sequence_parallel", None)
    if sequence is not None and sequence != layout.sequence_parallel:
        has = "has" if layout.sequence_parallel else "has no"
        raise RematError(
            f"Training(sequence_parallel={sequence}), but the model {has} SequenceParallel "
            f"style: state sequence_parallel={layout.sequence_parallel} (or leave it None, as "
            "the model is), or parallelize the model "
            + ("without" if layout.sequence_parallel else "with") + " SequenceParallel on "
            "its norms (and the matching input/output layouts)")
    return layout
