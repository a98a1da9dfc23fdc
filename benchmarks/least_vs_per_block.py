"""remat's least activation peak against per-block checkpointing's, by the allocator, in both
execution modes.

    python benchmarks/least_vs_per_block.py                       # the default models, 10 s solves
    python benchmarks/least_vs_per_block.py --models llama,unet_bn --modes eager --time-limit 5

The promise: in each execution mode, the least activation peak remat's planner reaches is at
most what checkpointing every block holds. Per (model, mode):

- remat's least: ``remat.optimize(..., activation_budget=1)`` raises BudgetError, whose
  `smallest` is the least budget the planner meets (`proven` where the search proved it the
  least); the model is then planned at ``activation_budget=smallest`` and its step run
  (compiled: ``plan.module(...)`` then backward; eager: ``plan.apply(model)`` then the model's
  step). Predicted: the plan's `activation_peak`; allocator: the step's measured activations.
- per-block checkpointing: eager, every block under ``torch.utils.checkpoint.checkpoint(...,
  use_reentrant=False)``: Hugging Face's ``gradient_checkpointing_enable({"use_reentrant":
  False})`` where the model supports it, else each block's forward wrapped (the blocks remat's
  eager mode checkpoints: the modules whose path ends in a list index, or the model's named
  `blocks`); compiled, ``remat.optimize(..., solver="checkpoint_blocks")`` run through
  ``plan.module``: remat's own per-block checkpointing in the compiled step.
- the verdict: remat's least, by the allocator and as predicted, at most per-block's allocator.

Steps and measurements are examples/hf_zoo.py's (`training_step`, `activation_peak`: the
allocator's peak by torch.profiler memory events on the CPU, less the state: parameters and
inputs before the step, gradients after it), so the numbers are the zoo's. Each step runs twice
before the measured one. A row that fails shows its error.
"""
from __future__ import annotations

import argparse
import copy
import logging
import sys
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

import torch
from tabulate import tabulate
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import remat  # noqa: E402
from examples.hf_zoo import activation_peak, training_step  # noqa: E402
from examples.zoo_models import build  # noqa: E402
from remat.errors import BudgetError  # noqa: E402
from remat.planner.job.budget import format_size  # noqa: E402
from remat.solvers import SolverOptions  # noqa: E402
from remat.solvers.core.blocks import block_of  # noqa: E402

MODES = ("compiled", "eager")
HF = ("llama", "gpt2", "distilbert", "marian", "vit", "convnext", "resnet", "qwen3_moe", "bamba")
CNN = ("unet", "unet_bn", "resnet_cnn")
SEED = 7


@dataclass
class Case:
    model: torch.nn.Module
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    blocks: list[str] | None = None
    """The modules to checkpoint in eager (remat's `blocks=`); None: the repeated blocks."""

    @property
    def hf(self) -> bool:
        return hasattr(self.model, "supports_gradient_checkpointing")


def _cnn(name: str) -> Case:
    if name == "unet":  # tests/models.py: long skips, convolutions and ReLUs
        from tests.models import unet
        model, args = unet()
        return Case(model, args)
    if name == "unet_bn":  # tests/fx_passes/test_eager_inplace_relu.py: BatchNorm, in-place ReLU
        from tests.fx_passes.test_eager_inplace_relu import _unet
        model, args = _unet()
        return Case(model, args, blocks=["inc", "down1", "down2", "up1", "up2"])
    from tests.models import resnet  # examples/resnet.py's model and inputs
    model, args = resnet(batch=16, size=32)
    return Case(model, args)


def make(name: str) -> Case:
    if name in CNN:
        return _cnn(name)
    model, kwargs = build(name)
    return Case(model, kwargs=kwargs)


def step_of(call: Callable, case: Case) -> Callable[[], None]:
    """hf_zoo's training step of `call` on the case's inputs: ``out.loss.backward()``, a model
    that returns its loss given it as ``.loss``."""
    if case.hf:
        return training_step(call, case.kwargs, seed=SEED)
    return training_step(lambda: SimpleNamespace(loss=call(*case.args, **case.kwargs)), {},
                         seed=SEED)


def measure(call: Callable, model: torch.nn.Module, case: Case) -> int:
    step = step_of(call, case)
    for _ in range(2):  # the first call of a compiled plan builds its step
        step()
    return activation_peak(step, model)


# ----------------------------------------------------------------------------- the row


@dataclass
class Row:
    model: str
    mode: str
    least: int | None = None
    proven: bool | None = None
    predicted: int | None = None
    allocator: int | None = None
    per_block: int | None = None
    per_block_how: str = ""
    seconds: float = 0.0
    error: str = ""

    def _at_most(self, mine: int | None) -> str:
        if mine is None or self.per_block is None:
            return ""
        return "yes" if mine <= self.per_block else f"NO (+{mine - self.per_block:,} B)"

    @property
    def verdict(self) -> str:
        """Both: remat's least by the allocator, and as predicted, at most per-block's."""
        if self.allocator is None or self.per_block is None:
            return ""
        return "yes" if self.allocator <= self.per_block >= self.predicted else "NO"

    def cells(self) -> list:
        def size(n):
            return "" if n is None else f"{n:,} ({format_size(n)})"
        proven = {True: "*", False: "", None: ""}[self.proven]
        ratio = ("" if self.allocator is None or not self.per_block
                 else f"{self.allocator / self.per_block:.2f}")
        return [self.model, self.mode,
                "" if self.least is None else f"{self.least:,}{proven}",
                size(self.predicted), size(self.allocator), size(self.per_block),
                self.per_block_how, ratio, self._at_most(self.allocator),
                self._at_most(self.predicted), f"{self.seconds:.0f} s",
                self.error[:120]]


HEADERS = ["model", "mode", "least (BudgetError)", "remat predicted", "remat allocator",
           "per-block allocator", "per-block by", "remat / per-block",
           "allocator <= per-block", "predicted <= per-block", "time", "error"]


def _first_line(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:200] if text else ''}"


def _optimize(model, case: Case, mode: str, budget: int, options: SolverOptions, **kw):
    return remat.optimize(model, activation_budget=budget, example_inputs=case.args,
                          example_kwargs=case.kwargs or None, execution=mode,
                          solver_options=options,
                          blocks=case.blocks if mode == "eager" else None, **kw)


def remat_least(row: Row, case: Case, options: SolverOptions) -> None:
    """BudgetError's least at budget 1, then a plan at it, run and measured."""
    try:
        _optimize(copy.deepcopy(case.model), case, row.mode, 1, options)
    except BudgetError as e:
        row.least, row.proven = e.smallest, e.proven
    if row.least is None:
        row.error = "least: no BudgetError with a smallest budget at activation_budget=1"
        return
    model = copy.deepcopy(case.model)
    try:
        plan = _optimize(model, case, row.mode, row.least, options)
    except Exception as e:  # the table reports every failure with its cause
        row.error = f"plan at least: {_first_line(e)}"
        return
    row.predicted = plan.activation_peak
    try:
        call = plan.module if row.mode == "compiled" else plan.apply(model)
        row.allocator = measure(call, model, case)
    except Exception as e:
        row.error = f"run at least: {_first_line(e)}"


def eager_per_block(case: Case) -> tuple[int, str]:
    model = copy.deepcopy(case.model)
    if case.hf and model.supports_gradient_checkpointing and case.blocks is None:
        model.gradient_checkpointing_enable({"use_reentrant": False})
        how = "HF gradient_checkpointing_enable"
    else:
        paths = case.blocks or sorted({b for n, _ in model.named_modules()
                                       if (b := block_of(n))})
        for path in paths:
            module = model.get_submodule(path)
            module.forward = partial(checkpoint, module.forward, use_reentrant=False)
        how = f"checkpoint on {len(paths)} blocks"
    return measure(model, model, case), how


def compiled_per_block(case: Case, options: SolverOptions) -> tuple[int, str]:
    model = copy.deepcopy(case.model)
    plan = _optimize(model, case, "compiled", 10**15, options, solver="checkpoint_blocks")
    return measure(plan.module, model, case), "remat checkpoint_blocks"


def run_row(name: str, mode: str, options: SolverOptions) -> Row:
    row = Row(name, mode)
    start = time.perf_counter()
    try:
        case = make(name)
    except Exception as e:
        row.error = f"build: {_first_line(e)}"
        return row
    try:
        remat_least(row, case, options)
    except Exception as e:
        row.error = f"least: {_first_line(e)}"
    try:
        row.per_block, row.per_block_how = (
            eager_per_block(case) if mode == "eager" else compiled_per_block(case, options))
    except Exception as e:
        row.error = (row.error + "; " if row.error else "") + f"per-block: {_first_line(e)}"
    row.seconds = time.perf_counter() - start
    return row


def _names(rows: list[Row]) -> str:
    return ", ".join(f"{r.model} {r.mode}" for r in rows) or "none"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(HF + CNN),
                        help=f"comma-separated: examples/zoo_models.py's names, or {', '.join(CNN)}")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--time-limit", type=float, default=10.0, help="seconds per solve")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR, format="remat: %(message)s")
    logging.getLogger("remat").setLevel(logging.ERROR)
    options = SolverOptions(time_limit=args.time_limit)
    rows = []
    for name in args.models.split(","):
        for mode in args.modes.split(","):
            row = run_row(name, mode, options)
            print(tabulate([row.cells()], tablefmt="plain", disable_numparse=True), flush=True)
            rows.append(row)
    print(f"\nleast = BudgetError.smallest at activation_budget=1 (* proven the least); predicted = "
          f"the plan at that budget's activation_peak; allocator = torch.profiler memory events "
          f"less the state (examples/hf_zoo.py activation_peak); CPU, fp32, "
          f"--time-limit {args.time_limit:g}")
    print(tabulate([r.cells() for r in rows], headers=HEADERS, disable_numparse=True))
    judged = [r for r in rows if r.verdict]
    above = [r for r in judged if r.verdict == "NO"]
    measured = [r for r in judged if r.allocator > r.per_block]
    print(f"\n{len(judged)} of {len(rows)} rows judged; remat's least above per-block "
          f"checkpointing by the allocator: {_names(measured)}; by the allocator or as "
          f"predicted: {_names(above)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
