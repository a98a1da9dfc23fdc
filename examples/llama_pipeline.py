"""examples/llama.py's decoder cut into pipeline stages, as torchtitan cuts its models for
`torch.distributed.pipelining`: the first stage embeds the tokens, every stage runs a range of
decoder layers (each stage computes its own rotary tables), the last one ends with the norm and
the output projection and returns the logits; the loss is the schedule's
(`pipeline_loss(logits, targets)`).

``llama_stages(model, stages)`` returns the stage modules sharing `model`'s parameters (their
names inside a stage: ``layers.<i>`` with the model's own layer numbers, so plans and
checkpoints name the same blocks as the whole model's).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from examples.llama import Llama, rotary

__all__ = ["LlamaStage", "llama_stages", "pipeline_loss"]


class LlamaStage(nn.Module):
    """Layers `first`..`last - 1` of `model`, with the embedding if `first` is 0 and the norm
    and output projection if `last` is the model's depth."""

    def __init__(self, model: Llama, first: int, last: int):
        super().__init__()
        self.config = model.config
        depth = len(model.layers)
        self.is_first, self.is_last = first == 0, last == depth
        if self.is_first:
            self.tok_embeddings = model.tok_embeddings
        # A ModuleDict keeps the model's layer numbers in the parameters' names.
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in range(first, last)})
        if self.is_last:
            self.norm = model.norm
            self.output = model.output

    def forward(self, x):
        c = self.config
        if self.is_first:
            x = self.tok_embeddings(x)
        cos, sin = rotary(x.shape[1], c.hidden // c.heads, c.rope_theta, x.device)
        for layer in self.layers.values():
            x = layer(x, cos, sin)
        if self.is_last:
            x = self.output(self.norm(x))
        return x


def llama_stages(model: Llama, stages: int) -> list[LlamaStage]:
    """`model` cut into `stages` stages of consecutive layers (the first ones one layer longer
    when the depth does not divide)."""
    depth = len(model.layers)
    if not 1 <= stages <= depth:
        raise ValueError(f"cannot cut {depth} layers into {stages} stages")
    sizes = [depth // stages + (k < depth % stages) for k in range(stages)]
    bounds = [sum(sizes[:k]) for k in range(stages + 1)]
    return [LlamaStage(model, bounds[k], bounds[k + 1]) for k in range(stages)]


def pipeline_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The schedule's loss: the model's own (examples/llama.py's `Llama.forward`)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def pipeline_runtime(modules: list[nn.Module], mine: list[int], schedule: str,
                     microbatches: int, plan=None, group=None):
    """This rank's `PipelineStage`s (`mine`: their indices into `modules`) and torch's
    `schedule` over them, with `pipeline_loss`. `plan`: a remat pipeline plan already applied
    to `modules`, whose runtime it prepares (zero-bubble's weight passes). `group`: the
    pipeline's process group (the "pp" dimension of a 2-D or 3-D mesh; None: the world)."""
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti, get_schedule_class

    stages = [PipelineStage(modules[s], s, len(modules), torch.device("cpu"), group=group)
              for s in mine]
    if plan is not None:
        plan.prepare_runtime(stages)
    cls = get_schedule_class(schedule)
    runtime = cls(stages if issubclass(cls, PipelineScheduleMulti) else stages[0],
                  microbatches, loss_fn=pipeline_loss)
    return stages, runtime


def rank_step(runtime, stages: int, mine: list[int], tokens: torch.Tensor,
              targets: torch.Tensor):
    """This rank's call of one pipeline step (the first stage is given the tokens, the last the
    targets), and the batch tensors it holds for it."""
    first, last = 0 in mine, stages - 1 in mine

    def step():
        runtime.step(*((tokens,) if first else ()), **({"target": targets} if last else {}),
                     return_outputs=False)

    return step, [tokens] * first + [targets] * last


def receive_buffers(stages) -> list[torch.Tensor]:
    """The receive buffers this rank's `PipelineStage`s hold from step to step: activations
    and, under multi-stage schedules, gradients. (torch 2.11 lists the first stage's model
    inputs as placeholders with no buffer, `_RootArgPlaceholder`.)"""
    return [i.buffer for st in stages
            for infos in [*st.args_recv_info.values(), *getattr(st, "grad_recv_info", {}).values()]
            for i in infos if getattr(i, "buffer", None) is not None]
