"""A ResNet with BatchNorm, planned and trained on the CPU.

    python examples/resnet.py

BatchNorm updates its running statistics in the forward: those ops are never recomputed (that
would update them twice), and the plan's step leaves the statistics exactly where eager
PyTorch leaves them. The script checks it, and the gradients, against an eager copy.
"""
from __future__ import annotations

import copy
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import remat  # noqa: E402
from remat.solvers import SolverOptions  # noqa: E402
from tests.models import resnet  # noqa: E402


def main() -> None:
    model, (images, labels) = resnet(batch=16, size=32)
    eager = copy.deepcopy(model)
    everything = remat.optimize(model, activation_budget=10**12, example_inputs=(images, labels),
                                solver="save_all")
    plan = remat.optimize(model, activation_budget=int(everything.activation_peak * 0.75),
                          example_inputs=(images, labels),
                          solver_options=SolverOptions(time_limit=20))
    print(plan.report().render())

    plan.module(images, labels).backward()
    eager(images, labels).backward()
    grads = max((a.grad - b.grad).abs().max().item()
                for a, b in zip(model.parameters(), eager.parameters()))
    stats = max((a - b).abs().max().item() for a, b in zip(model.buffers(), eager.buffers()))
    print(f"largest gradient difference from eager: {grads:.2e}; "
          f"largest running-statistics difference: {stats:.2e}")


if __name__ == "__main__":
    main()
