"""examples/llama.py's decoder parallelized over a tensor-parallel mesh with DTensor, as torchtitan
parallelizes Llama: the embedding row-wise (vocabulary), the attention's query/key/value and
the MLP's gate and up projections column-wise, their output projections row-wise, the output
layer column-wise with its logits gathered; with `sequence_parallel`, the norms and the
residual stream sharded along the sequence, gathered before the attention and the MLP and
reduce-scattered after them.

``parallelize_llama(model, mesh, sequence_parallel=False)`` parallelizes in place and returns
the model; each rank then holds 1 / N of the heads and of the MLP.
"""
from __future__ import annotations

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                               RowwiseParallel, SequenceParallel,
                                               parallelize_module)

from examples.llama import Llama

__all__ = ["parallelize_llama"]


def parallelize_llama(model: Llama, mesh, sequence_parallel: bool = False) -> Llama:
    size = mesh.size()
    c = model.config
    if c.heads % size or (c.kv_heads or c.heads) % size or c.mlp % size:
        raise ValueError(f"{size} tensor-parallel ranks do not divide the heads and the MLP")
    residual = Shard(1) if sequence_parallel else Replicate()
    top = {"tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=residual),
           "output": ColwiseParallel(input_layouts=residual, output_layouts=Replicate())}
    if sequence_parallel:
        top["norm"] = SequenceParallel()
    parallelize_module(model, mesh, top)
    for layer in model.layers:
        plan = {"attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
                "attention.wv": ColwiseParallel(),
                "attention.wo": RowwiseParallel(output_layouts=residual),
                "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel(output_layouts=residual)}
        if sequence_parallel:
            plan.update({
                "attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel(),
                "attention": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                                desired_input_layouts=(Replicate(), None, None)),
                "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),),
                                                   desired_input_layouts=(Replicate(),))})
        parallelize_module(layer, mesh, plan)
        # The attention computes with this rank's heads.
        layer.attention.heads //= size
        layer.attention.kv_heads //= size
    return model
