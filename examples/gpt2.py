"""GPT-2 from transformers, built from a config (nothing is downloaded), planned at a budget.

    python examples/gpt2.py                 # GPT-2 small, batch 8, sequence 512, on meta tensors
    python examples/gpt2.py --budget 6GB --batch 16

The model is built on the meta device, so planning allocates no weight; the report shows the
memory of the whole step (bf16 mixed precision, AdamW) and what the plan recomputes.
"""
from __future__ import annotations

import argparse

import torch

import remat
from remat.solvers import SolverOptions


class WithLabels(torch.nn.Module):
    """Calls the model with labels = inputs, so that its output carries the loss."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(input_ids=ids, labels=ids)


def main(argv=None) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", default="12GB")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--time-limit", type=float, default=60.0)
    args = parser.parse_args(argv)

    config = GPT2Config(n_layer=args.layers, attn_implementation="sdpa")
    with torch.device("meta"):
        # bf16 weights: under bf16 mixed precision the activations are bf16 (the fp32 master
        # copy and gradients are counted by the Training configuration).
        model = GPT2LMHeadModel(config).to(torch.bfloat16).train()
    model.loss_type = "ForCausalLM"
    ids = torch.zeros(args.batch, args.seq, dtype=torch.long, device="meta")
    plan = remat.optimize(WithLabels(model), args.budget, example_inputs=(ids,),
                          training=remat.Training(precision="bf16-mixed", optimizer="adamw"),
                          target="h100", solver_options=SolverOptions(time_limit=args.time_limit))
    print(plan.report().render())


if __name__ == "__main__":
    main()
