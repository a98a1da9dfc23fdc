"""A Hugging Face GPT-2 trained in a plain loop with an eager remat plan, in place of
`gradient_checkpointing_enable()`.

    python examples/hf_gpt2_eager.py

Builds a small GPT-2 from a config (nothing is downloaded), plans it for eager training with
an activation budget 5 % above what Hugging Face's gradient checkpointing holds (its measured
peak), and wraps its blocks in place with
`plan.apply(model)`: the model keeps its class, its parameter names and its call signature,
so the loop calls `model(input_ids=..., labels=...)` as before. It trains three copies (plain,
Hugging Face's gradient checkpointing, remat) with the same data and dropout masks and prints
each step's loss and the allocator's peak (torch.profiler memory events) of the first step.
"""
from __future__ import annotations

import copy
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import remat  # noqa: E402
from remat.fx_passes.measuring.allocator import allocator_peak  # noqa: E402
from remat.solvers import SolverOptions, Strategy  # noqa: E402


class WithLabels(torch.nn.Module):
    """The model called with labels = inputs, so that its forward returns `.loss` (what
    `optimize` captures); it shares the model, and `plan.apply` wraps the model's blocks."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        return self.model(input_ids=input_ids, labels=input_ids)


def gpt2(seed: int = 0):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=256, n_positions=128, n_embd=128, n_layer=4, n_head=4,
                        attn_implementation="sdpa")
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(config).train()
    model.loss_type = "ForCausalLM"
    model.config.use_cache = False  # training keeps no key/value cache (optimize checks)
    return model


def train(model, batches, steps: int) -> tuple[list[float], int]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses, peak = [], 0
    for step in range(steps):
        ids = batches[step]

        def one():
            torch.manual_seed(step)  # the same dropout masks for every copy
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            return float(loss.detach())

        if step == 0:
            peak, loss = allocator_peak(one)
        else:
            loss = one()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss)
    return losses, peak


def main(steps: int = 3, batch: int = 4, seq: int = 64) -> None:
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 256, (batch, seq), generator=g) for _ in range(steps)]
    model = gpt2()
    plain_losses, plain_peak = train(copy.deepcopy(model), batches, steps)

    hf = copy.deepcopy(model)
    hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    hf_losses, hf_peak = train(hf, batches, steps)

    # About the memory of gradient checkpointing every block (5 % more), for less recompute.
    budget = int(1.05 * hf_peak)
    plan = remat.optimize(WithLabels(model), activation_budget=budget,
                          example_inputs=(batches[0],), execution="eager",
                          solver_options=SolverOptions(time_limit=10))
    plan.apply(WithLabels(model))  # wraps model.transformer.h.* in place
    remat_losses, remat_peak = train(model, batches, steps)

    whole = plan.prepared.baselines[Strategy.CHECKPOINT_BLOCKS].recompute_flops
    print(f"activation budget {budget:,} bytes; remat predicts {plan.activation_peak:,}, "
          f"recomputing {plan.recompute_flops / 1e6:.1f} MFLOP per step (every block's "
          f"forward: {whole / 1e6:.1f} MFLOP)")
    rows = [("plain PyTorch", plain_peak, plain_losses),
            ("gradient_checkpointing_enable()", hf_peak, hf_losses),
            ("remat eager plan", remat_peak, remat_losses)]
    for name, peak, losses in rows:
        print(f"{name:34s} peak {peak:>12,} B   losses {', '.join(f'{x:.6f}' for x in losses)}")


if __name__ == "__main__":
    main()
