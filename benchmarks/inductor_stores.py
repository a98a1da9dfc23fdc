"""What one output of a fused kernel costs Inductor to write, by dtype, against eager PyTorch:
a lead on why a compiled plan that saves a ReLU's mask runs slower than one that saves none.

Each row compiles one pointwise function of a float32 tensor (a U-Net activation's shape by
default: 4 x 16 x 64 x 64, 262,144 elements) whose only output is the stored value:
- `bool mask`: ``relu(x) <= 0``, the mask a ReLU's backward reads (what a plan saves when it
  saves the mask);
- `uint8`: the same mask stored as bytes;
- `int8 index`: a 2 x 2 max-pool's argmax within its window, as Inductor stores pooling
  indices (a quarter of the elements);
- `float32`: ``relu(x) * 2``, the ReLU's output itself.

Printed: the fastest of `--steps` calls of Inductor's kernel (`torch.compile`) and of the same
function run eagerly, in microseconds, and nanoseconds an element of the output.

    python benchmarks/inductor_stores.py [--device cpu|cuda] [--shape 4 16 64 64] [--steps 50]
"""
from __future__ import annotations

import argparse

import torch
from tabulate import tabulate

from remat.fx_passes.compiled.measure_step import time_step


def bool_mask(x: torch.Tensor) -> torch.Tensor:
    return torch.relu(x) <= 0


def uint8_mask(x: torch.Tensor) -> torch.Tensor:
    return (torch.relu(x) <= 0).to(torch.uint8)


def int8_index(x: torch.Tensor) -> torch.Tensor:
    _, index = torch.nn.functional.max_pool2d_with_indices(torch.relu(x), 2)
    return index.to(torch.int8)


def float32(x: torch.Tensor) -> torch.Tensor:
    return torch.relu(x) * 2


FUNCTIONS = {"bool mask": bool_mask, "uint8": uint8_mask, "int8 index": int8_index,
             "float32": float32}


def fastest(fn, x: torch.Tensor, steps: int) -> float:
    """The fastest of `steps` calls, in seconds, after three warm-up calls (the compile)."""
    def call() -> None:
        fn(x)
        if x.is_cuda:
            torch.cuda.synchronize()
    return time_step(call, repeat=steps, warmup=3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--shape", nargs=4, type=int, default=[4, 16, 64, 64])
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args()
    x = torch.randn(*args.shape, generator=torch.Generator().manual_seed(0)).to(args.device)
    rows = []
    for name, fn in FUNCTIONS.items():
        torch._dynamo.reset()
        compiled = torch.compile(fn)
        elements = fn(x).numel()
        inductor, eager = fastest(compiled, x, args.steps), fastest(fn, x, args.steps)
        rows.append([name, elements, f"{1e6 * inductor:.1f}", f"{1e6 * eager:.1f}",
                     f"{1e9 * inductor / elements:.2f}", f"{inductor / eager:.2f}x"])
    print(f"torch {torch.__version__}, {args.device}, input {tuple(args.shape)}")
    print(tabulate(rows, headers=["output", "elements", "Inductor us", "eager us",
                                  "Inductor ns/element", "Inductor / eager"]))


if __name__ == "__main__":
    main()
