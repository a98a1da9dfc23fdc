"""Capturing the training step: dynamo and AOTAutograd trace forward and backward into one
joint fx graph (`capture`), with the inputs, outputs and loss checked and explained
(`step_io`), random ops snapshotted so a recomputation draws the same numbers (`rng`), and a
large model captured on a few of its repeated blocks and replicated (`replicate`,
`replicate_graph`). `names` spells ops and module paths one way for every pass above.

The lowest floor of `remat.fx_passes`: it imports nothing from the sub-packages beside it."""
from remat.fx_passes.tracing.capture import (Captured, capture, compile_step, default_loss,
                                             make_backend)
from remat.fx_passes.tracing.names import module_path, target_name
from remat.fx_passes.tracing.replicate import ReplicatedCapture, capture_replicated

__all__ = ["Captured", "capture", "compile_step", "default_loss", "make_backend",
           "module_path", "target_name", "ReplicatedCapture", "capture_replicated"]
