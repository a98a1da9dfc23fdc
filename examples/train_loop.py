"""A plain training loop on `plan.module`, beside the same loop in eager PyTorch.

    python examples/train_loop.py

Plans a small Llama-style model (examples/llama.py) on the CPU at an activation budget halfway
between checkpointing every block and saving everything, then trains a copy of it eagerly and
the original through the plan, with one AdamW optimizer each built on the model's own
parameters, and prints both losses at every step: they agree, because a plan never changes
the numbers.
"""
from __future__ import annotations

import copy
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import remat  # noqa: E402
from llama import LLAMA_TINY, llama  # noqa: E402
from remat.solvers import SolverOptions  # noqa: E402


def main(steps: int = 5) -> None:
    model, (idx, targets) = llama(LLAMA_TINY, batch=8)
    eager = copy.deepcopy(model)

    # Bound the activations alone: a tiny model's state is not what this example is about.
    probe = remat.optimize(model, activation_budget=10**12, example_inputs=(idx, targets),
                           solver="save_all")
    save_all_peak = probe.activation_peak
    plan = remat.optimize(model, activation_budget=int(save_all_peak * 0.7),
                          example_inputs=(idx, targets),
                          solver_options=SolverOptions(time_limit=20))
    print(plan)

    step = plan.module  # shares `model`'s parameters
    planned_opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    eager_opt = torch.optim.AdamW(eager.parameters(), lr=1e-3)
    print(f"{'step':>4}  {'eager loss':>12}  {'planned loss':>12}")
    for i in range(steps):
        eager_opt.zero_grad()
        eager_loss = eager(idx, targets)
        eager_loss.backward()
        eager_opt.step()

        planned_opt.zero_grad()
        loss = step(idx, targets)
        loss.backward()
        planned_opt.step()
        print(f"{i:>4}  {eager_loss.item():>12.6f}  {loss.item():>12.6f}")
    worst = max((a - b).abs().max().item()
                for a, b in zip(model.parameters(), eager.parameters()))
    print(f"largest weight difference after {steps} steps: {worst:.2e}")


if __name__ == "__main__":
    main()
