"""The zoo's eager plans applied by `plan.compile_blocks(model)`: each block compiled with
remat's partitioner (torchtitan's per-block compile) instead of wrapped in checkpoint.

    python benchmarks/compile_blocks_zoo.py                       # every architecture
    python benchmarks/compile_blocks_zoo.py --archs gpt2,llama,t5 --time-limit 10

For each architecture, built as examples/zoo_models.py builds it (transformers' testers), the
eager plan is made as examples/hf_zoo.py makes its eager row: the budget half-way (`--fraction`)
between remat's eager timeline with every block checkpointed and with none (per-block
checkpointing's own peak where that is more). A fresh copy of the model gets
``plan.compile_blocks(model)`` (op by op: ``inductor=False``); the training step runs twice
(the first compiles each block) and the third is measured by the allocator as the zoo measures
its rows (`examples.hf_zoo.activation_peak`: torch.profiler memory events on the CPU, less the
state). Gradients are compared with plain eager PyTorch's (same seed; dropout replayed, as in
the zoo), relative to the largest eager gradient; the allocator's activation peak with the
eager plan's prediction (which models checkpoint's recomputation, all of a block's uncached
ops at once; the compiled blocks recompute one value at a time, just before its use). A row
that fails gives the exception's type and first line.
"""
from __future__ import annotations

import argparse
import copy
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from examples.hf_zoo import (_first_line, activation_peak, budget_range, grad_diff,  # noqa: E402
                             gradient_cell, gradients, percent_over, training_step)
from examples.zoo_models import ARCHS, build  # noqa: E402
from remat.planner.plans.eager_plan import eager_structure, plan_eager_mode  # noqa: E402
from remat.planner.plans.prepare import prepare  # noqa: E402
from remat.solvers import SolverOptions, Strategy  # noqa: E402


@dataclass
class Row:
    arch: str
    stage: str = ""
    """Where it stopped: "" (ran), "capture", "plan", "compile_blocks" or "run"."""
    error: str = ""
    grad_diff: float | None = None
    predicted: int | None = None
    allocator: int | None = None
    applied: int | None = None
    """The allocator's activation peak of the same plan by `plan.apply(model)` (checkpoint)."""
    recomputed: int | None = None
    """Values the compiled blocks' backwards recompute, over all blocks."""
    blocks: int | None = None
    seconds: float | None = None
    note: str = ""
    """Where a compiled block's forward ops differ from the plan's (compile_blocks warns)."""

    @property
    def over(self) -> float | None:
        return percent_over(self.allocator, self.predicted)

    def cells(self) -> list:
        grads = gradient_cell(self.grad_diff)
        return [self.arch, "ok" if not self.error else f"{self.stage}: {self.error}"[:110],
                "" if self.blocks is None else self.blocks,
                "" if self.recomputed is None else self.recomputed, grads,
                "" if self.predicted is None else f"{self.predicted:,}",
                "" if self.allocator is None else f"{self.allocator:,}",
                "" if self.over is None else f"{self.over:+.2f} %",
                "" if self.applied is None else f"{self.applied:,}",
                "" if self.seconds is None else f"{self.seconds:.0f} s", self.note]


HEADERS = ["architecture", "result", "blocks", "recomputed", "gradients", "predicted",
           "allocator", "over", "applied", "time",
           "ops differ"]


class _Differences(logging.Handler):
    """compile_blocks' warnings where a block compiled to other ops than the plan's, for the
    row's note: how many blocks dropped ops of the plan, made ops from no input, and made ops
    the plan never saw that no backward op needs."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.dropped: set[str] = set()
        self.made: set[str] = set()
        self.unread: set[str] = set()

    def emit(self, record):
        block = str(record.args[0])
        if "computed from no input" in record.msg:
            self.made.add(block)
        elif "no backward op needs" in record.msg:
            self.unread.add(block)
        elif "does not run" in record.msg:
            self.dropped.add(block)

    def note(self) -> str:
        return ", ".join(part for part in (
            f"{len(self.dropped)} blocks without ops of the plan" if self.dropped else "",
            f"{len(self.made)} with ops from no input" if self.made else "",
            f"{len(self.unread)} with ops no backward needs" if self.unread else "") if part)


def run_arch(name: str, options: SolverOptions, fraction: float = 0.5) -> Row:
    row = Row(name)
    start = time.perf_counter()
    torch._dynamo.reset()  # each architecture's blocks compile from a clean cache
    stage = "capture"
    try:
        base, kwargs = build(name)
        reference = copy.deepcopy(base)
        training_step(reference, kwargs, seed=7)()  # eager PyTorch's gradients, same seed
        expected = gradients(reference)
        del reference
        prepared = prepare(copy.deepcopy(base), example_kwargs=kwargs)
        stage = "plan"
        eager = eager_structure(copy.deepcopy(base), prepared, None, (), kwargs)[:2]
        low, high = budget_range("eager", prepared, eager)
        budget = max(int(low + fraction * (high - low)), low)
        plan = plan_eager_mode(copy.deepcopy(base), prepared, budget=None,
                               activation_budget=budget, target="h100",
                               solver=Strategy.OPTIMAL, solver_options=options, blocks=None,
                               example_inputs=(), example_kwargs=kwargs)
        row.predicted = plan.activation_peak
        applied = copy.deepcopy(base)
        step = training_step(plan.apply(applied), kwargs, seed=7)
        step()
        row.applied = activation_peak(step, applied)
        del applied, step
        stage = "compile_blocks"
        model = plan.compile_blocks(copy.deepcopy(base))
        row.blocks = len(model.remat_partitions)
        stage = "run"
        step = training_step(model, kwargs, seed=7)
        differences = _Differences()
        logger = logging.getLogger("remat.fx_passes.compiled.block_compile")
        logger.addHandler(differences)
        try:
            for _ in range(2):  # the first compiles each block
                step()
        finally:
            logger.removeHandler(differences)
        row.note = differences.note()
        row.allocator = activation_peak(step, model)
        row.grad_diff = grad_diff(expected, model)
        row.recomputed = sum(len(p.recomputed) for made in model.remat_partitions.values()
                             for p in made[-1:])
    except Exception as e:  # the table reports every failure with its cause
        row.stage, row.error = stage, _first_line(e)
        logging.getLogger("remat").debug("%s failed", name, exc_info=True)
    row.seconds = time.perf_counter() - start
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--archs", default=",".join(ARCHS),
                        help=f"comma-separated, from {', '.join(ARCHS)}")
    parser.add_argument("--time-limit", type=float, default=10.0, help="seconds per solve")
    parser.add_argument("--fraction", type=float, default=0.5,
                        help="the budget's place between per-block checkpointing (0) and "
                             "saving everything (1)")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="remat's log, with each failure's traceback")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.ERROR,
                        format="remat: %(message)s")
    logging.getLogger("remat").setLevel(logging.DEBUG if args.verbose else logging.ERROR)
    # compile_blocks' warnings go to the rows' notes
    logging.getLogger("remat.fx_passes.compiled.block_compile").setLevel(logging.WARNING)
    options = SolverOptions(time_limit=args.time_limit)
    rows = []
    for name in args.archs.split(","):
        row = run_arch(name, options, args.fraction)
        print(tabulate([row.cells()], tablefmt="plain", disable_numparse=True), flush=True)
        rows.append(row)
    print(f"\nplan.compile_blocks(model) on the zoo (CPU, fp32, op by op): the eager plan at "
          f"{args.fraction:g} of the way between per-block checkpointing and saving everything; "
          "recomputed = values the blocks' backwards recompute; gradients: max |compiled - "
          "eager| relative to the largest |eager gradient|; predicted = the eager plan's "
          "activation peak, allocator = torch.profiler memory events less the state (third "
          "step); over = allocator against predicted; applied = the allocator's peak of the same "
          "plan by plan.apply(model), eager checkpointing")
    print(tabulate([r.cells() for r in rows], headers=HEADERS, disable_numparse=True))
    for r in rows:
        if r.error:
            print(f"\n{r.arch} ({r.stage}): {r.error}")
    ran = [r for r in rows if not r.error]
    print(f"\n{len(ran)} of {len(rows)} ran; {sum(r.allocator > r.predicted for r in ran)} "
          f"above the prediction; {sum(r.grad_diff != 0 for r in ran)} with gradients not "
          "bitwise equal")
    return 0


if __name__ == "__main__":
    sys.exit(main())
