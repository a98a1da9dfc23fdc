"""An eager plan under torch.compile, by the allocator (CPU profiler memory events).

A tiny GPT (`tests.models.gpt`, dropout 0) planned in eager mode at `--fraction` of its save-all
activation peak, applied, then run (the third step of each, after compiles and warm-up) as:
plain eager, the applied model in eager mode, and `torch.compile` of the plain and of the
applied model under each `--backends` (aot_eager: AOTAutograd's graphs run op by op; inductor:
fused and compiled). Columns: the allocator's activation peak (the step's peak less the
gradients it leaves), the eager plan's prediction, the matmuls the compiled backward graph runs
again (aot_eager only), and the largest gradient difference from the same mode without the
plan.

    python benchmarks/compile_applied.py [--fraction 0.6] [--backends aot_eager inductor]
"""
from __future__ import annotations

import argparse
import copy
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tabulate import tabulate  # noqa: E402
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.backends.debugging import boxed_nop  # noqa: E402

import remat  # noqa: E402
from remat.solvers import SolverOptions  # noqa: E402
from tests import models  # noqa: E402
from tests.allocator import allocator_peak  # noqa: E402

ADDMM = "aten.addmm.default"


def activation_peak(call, model, inputs) -> int:
    model.zero_grad(set_to_none=True)
    peak, _ = allocator_peak(lambda: call(*inputs).backward())
    return peak - sum(p.grad.numel() * p.grad.element_size() for p in model.parameters())


def recording_aot_eager():
    """aot_eager with the backward graphs AOTAutograd compiles recorded."""
    graphs: list[torch.fx.GraphModule] = []

    def backward(gm, example_inputs):
        graphs.append(gm)
        return boxed_nop(gm, example_inputs)  # aot_eager's: frees each input after its use
    return graphs, aot_autograd(fw_compiler=boxed_nop, bw_compiler=backward)


def run(fraction: float, backends: list[str]) -> list[list]:
    model, inputs = models.gpt(models.GPTConfig(dropout=0.0))
    save_all = remat.optimize(copy.deepcopy(model), activation_budget=10**12,
                              example_inputs=inputs, solver="save_all").activation_peak
    plan = remat.optimize(copy.deepcopy(model), activation_budget=int(fraction * save_all),
                          example_inputs=inputs, execution="eager",
                          solver_options=SolverOptions(time_limit=10))
    rows = []

    def measure(name, call, target, reference=None, graphs=None):
        for _ in range(3):  # the first calls compile; the third is the step measured
            peak = activation_peak(call, target, inputs)
        diff = "" if reference is None else max(
            (p.grad - q.grad).abs().max().item()
            for p, q in zip(target.parameters(), reference.parameters()))
        recomputed = "" if graphs is None else sum(
            str(n.target) == ADDMM for gm in graphs[-1:] for n in gm.graph.nodes)
        rows.append([name, f"{peak:,}", f"{plan.activation_peak:,}", recomputed,
                     diff if diff == "" else f"{diff:.1e}"])

    plain = copy.deepcopy(model)
    measure("eager, no plan", plain, plain)
    applied = plan.apply(copy.deepcopy(model))
    measure("eager, plan applied", applied, applied, reference=plain)
    for backend in backends:  # the backward graphs are counted under aot_eager only
        recorded = backend == "aot_eager"
        plain_c = copy.deepcopy(model)
        graphs, compiler = recording_aot_eager() if recorded else (None, backend)
        measure(f"torch.compile({backend}), no plan", torch.compile(plain_c, backend=compiler),
                plain_c, graphs=graphs)
        applied_c = plan.apply(copy.deepcopy(model))
        graphs, compiler = recording_aot_eager() if recorded else (None, backend)
        measure(f"torch.compile({backend}), plan applied",
                torch.compile(applied_c, backend=compiler), applied_c, reference=plain_c,
                graphs=graphs)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fraction", type=float, default=0.6)
    parser.add_argument("--backends", nargs="+", default=["aot_eager", "inductor"])
    args = parser.parse_args()
    rows = run(args.fraction, args.backends)
    print(tabulate(rows, headers=["step", "allocator activations", "eager plan predicts",
                                  "addmm in backward", "max grad diff"],
                   disable_numparse=True))


if __name__ == "__main__":
    main()
