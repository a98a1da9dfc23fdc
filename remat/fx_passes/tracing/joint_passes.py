"""The passes every joint graph gets, when it is captured and when a plan is applied to it, so
that the problem and the graph it runs on agree (`prepare_joint`)."""
from __future__ import annotations

import torch
from torch import fx

from remat.fx_passes.tracing.inductor_forms import inductor_forms
from remat.fx_passes.tracing.rng import snapshot_random_ops
from remat.fx_passes.tracing.softmax_loss import read_from_logits
from remat.fx_passes.tracing.unbacked import bound_data_dependent

__all__ = ["drop_unused_running_stats", "prepare_joint"]


def prepare_joint(joint: fx.GraphModule, label: str = "the model", *,
                  inductor: bool = False) -> None:
    """The passes every joint graph gets, when it is captured and when a plan is applied to it,
    so that the problem and the graph it runs on agree: sizes that depend on the data at their
    worst case (`remat.fx_passes.tracing.unbacked`); for a plan Inductor compiles
    (`inductor`), Inductor's forms (`remat.fx_passes.tracing.inductor_forms`) and log-softmax's
    backward read from the logits (`remat.fx_passes.tracing.softmax_loss`)."""
    bound_data_dependent(joint, label)
    drop_unused_running_stats(joint)
    snapshot_random_ops(joint)
    if inductor:
        inductor_forms(joint)
        read_from_logits(joint)


def drop_unused_running_stats(joint: fx.GraphModule) -> None:
    """In training, ``native_batch_norm_backward`` reads only ``save_mean`` and ``save_invstd``;
    its ``running_mean`` and ``running_var`` arguments are unused (by the ATen kernels and the
    decomposition alike). AOTAutograd passes there the statistics' new values, which the step
    also copies into the buffers: read by the backward, they would be saved until their layer's
    backward, where eager saves nothing for them. Pass None instead, as the schema allows."""
    changed = False
    for node in joint.graph.find_nodes(op="call_function",
                                       target=torch.ops.aten.native_batch_norm_backward.default):
        args = list(node.args)
        if len(args) > 7 and args[7] is True and (args[3] is not None or args[4] is not None):
            args[3] = args[4] = None
            node.args = tuple(args)
            changed = True
    if changed:
        joint.recompile()
