"""The zoo: Hugging Face architectures as transformers' own tests build them
(`examples/zoo_models.py`), each planned in both execution modes and judged by eager PyTorch.

    python examples/hf_zoo.py                                # every architecture, 10 s solves
    python examples/hf_zoo.py --archs llama,t5,mixtral --time-limit 5 --out zoo.json
    python examples/hf_zoo.py --archs llama,vit --inductor   # and two Inductor rows each

For each architecture, built as its `ModelTester` builds it and in train mode (dropout on where
the tester sets it), remat captures the step once, ``model(**kwargs).loss.backward()``, and
plans it in each mode at an activation budget half-way (`--fraction` moves it) between what
that mode holds with per-block checkpointing and with saving everything, in remat's own
simulated figures: for compiled, the joint graph's baselines; for eager, remat's eager
timeline with every block checkpointed and nothing cached, and with no block checkpointed
(what plain eager PyTorch holds). Where checkpointing every block holds more than saving
everything (its copies of the random state and of the block inputs outweigh what it frees:
DeepSeek-V3 in eager), the budget is per-block checkpointing's own peak, the least
of the range that the mode's plans reach. Then, in each mode:

- compiled: ``plan.module(**kwargs)``, the rewritten joint graph;
- eager: ``plan.apply(model)``, per-block selective checkpointing in the model itself.

The row gives the solver's status and gap, whether the gradients equal eager PyTorch's (the
largest difference over all parameters, same seed: dropout is replayed), the plan's predicted
activation peak and the allocator's (remat.fx_passes.measuring.allocator: torch.profiler memory
events on the CPU, the step's peak less the state: parameters before the step, gradients after
it; there is no optimizer), how far the allocator is above (+) or below (-) the prediction, the
planning time, and the error where a step failed. Beside them, both modes' least budgets: the
smallest activation budget each mode's planner can meet (compiled: the peak the exact solver
names in its BudgetError at budget 0; eager: the least eager peak of any per-block policy,
CP-SAT over the eager timeline), "proven" where the search proved it the least. The promise is that no row is above its
prediction, and none more than 2 % below it without a stated reason.

`--inductor` adds two rows per architecture (`examples/zoo_inductor.py`): remat's plan
compiled by Inductor (``compile=True``) at the compiled row's budget, and an eager plan made
with ``compile=True`` at the eager row's budget, applied and compiled by ``torch.compile``
(`--inductor-rows` picks one of them); docs/inductor.md, "The zoo under Inductor", has their
table.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import logging
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch
from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from examples.zoo_models import ARCHS, build  # noqa: E402
from remat.errors import BudgetError  # noqa: E402
from remat.fx_passes.measuring.allocator import allocator_peak  # noqa: E402
from remat.planner.job.budget import format_size  # noqa: E402
from remat.planner.plans.eager_plan import eager_structure, plan_eager_mode  # noqa: E402
from remat.planner.plans.plan import plan_prepared  # noqa: E402
from remat.planner.plans.prepare import prepare  # noqa: E402
from remat.solvers import SolverOptions, Strategy, solve  # noqa: E402
from remat.solvers.eager.search import least_eager_peak  # noqa: E402
from remat.solvers.timeline.eager import eager_schedule  # noqa: E402

MODES = ("compiled", "eager")


# ----------------------------------------------------------------------------- measuring


def gradient_bytes(model: torch.nn.Module) -> int:
    """Bytes of the parameters' gradients after a step: part of the state, which the one
    meaning of activations takes out of the step's peak (remat.planner.job.accounting)."""
    return sum(p.grad.numel() * p.grad.element_size() for p in model.parameters()
               if p.grad is not None)


def activation_peak(step: Callable[[], None], model: torch.nn.Module) -> int:
    """The allocator's peak of `step()` less the gradients it leaves in `model`: the step's
    peak less the state (parameters and inputs are held before it begins, so the allocator's
    baseline; there is no optimizer state). Calls `step` on a model with no gradients."""
    zero(model)
    peak = allocator_peak(step)
    return peak - gradient_bytes(model)


def training_step(call: Callable, kwargs: dict, seed: int) -> Callable[[], None]:
    def step():
        torch.manual_seed(seed)
        out = call(**kwargs)
        out.loss.backward()  # the output (logits...) is held until after the backward, as in
        del out              # a loop that logs it
    return step


def gradients(model: torch.nn.Module) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.clone() for p in model.parameters()]


def grad_diff(reference: list[torch.Tensor | None], model: torch.nn.Module) -> float:
    """The largest |difference| between `model`'s gradients and the `reference` ones, relative
    to the largest |reference gradient|: 0 where they are bitwise equal. Relative because a
    plan may run float sums in another order than eager PyTorch (a decomposed op, experts
    accumulated by `index_put`), whose rounding scales with the gradients' size, not with any
    fixed number; a wrong recomputation moves gradients by a sizeable fraction of it."""
    worst, scale = 0.0, 0.0
    for r, p in zip(reference, model.parameters()):
        if (r is None) != (p.grad is None):
            return float("inf")
        if r is not None:
            worst = max(worst, (r - p.grad).abs().max().item())
            scale = max(scale, r.abs().max().item())
    return worst / scale if scale else (0.0 if worst == 0 else float("inf"))


def zero(model: torch.nn.Module) -> None:
    for p in model.parameters():
        p.grad = None


# ----------------------------------------------------------------------------- the table


def percent_over(allocator: int | None, predicted: int | None) -> float | None:
    """How far the allocator is above the prediction, in % of it (negative: below)."""
    if allocator is None or not predicted:
        return None
    return 100 * (allocator - predicted) / predicted


def gradient_cell(diff: float | None) -> str:
    """A row's gradients: "equal" to eager's, or the largest relative difference."""
    return "" if diff is None else ("equal" if diff == 0 else f"{diff:.0e}")


@dataclass
class Row:
    arch: str
    family: str
    mode: str
    budget: int = 0
    blocks_peak: int | None = None
    """This mode's activations with every block checkpointed (nothing cached), simulated."""
    save_all_peak: int | None = None
    """This mode's activations saving everything (eager: no block checkpointed), simulated."""
    status: str = ""
    gap: float | None = None
    grad_diff: float | None = None
    predicted: int | None = None
    allocator: int | None = None
    plan_seconds: float | None = None
    least_compiled: int | None = None
    least_compiled_proven: bool = False
    least_eager: int | None = None
    least_eager_proven: bool = False
    error: str = ""
    note: str = ""
    """remat's warnings while planning (a block running other code in eager than captured)."""

    @property
    def over(self) -> float | None:
        return percent_over(self.allocator, self.predicted)

    def cells(self) -> list:
        grads = gradient_cell(self.grad_diff)
        between = ("" if self.blocks_peak is None else
                   f"{format_size(self.blocks_peak)} .. {format_size(self.save_all_peak)}")
        return [self.arch, self.family, self.mode, format_size(self.budget) if self.budget
                else "", between, _least(self.least_compiled, self.least_compiled_proven),
                _least(self.least_eager, self.least_eager_proven), self.status,
                "" if self.gap is None else f"{100 * self.gap:.1f} %",
                grads, "" if self.predicted is None else f"{self.predicted:,}",
                "" if self.allocator is None else f"{self.allocator:,}",
                "" if self.over is None else f"{self.over:+.2f} %",
                "" if self.plan_seconds is None else f"{self.plan_seconds:.0f} s",
                (self.error or self.note)[:90]]


def _least(size: int | None, proven: bool) -> str:
    return "" if size is None else f"{format_size(size)}{'*' if proven else ''}"


HEADERS = ["architecture", "family", "mode", "budget", "blocks .. save all", "least compiled",
           "least eager", "status", "gap", "gradients", "predicted", "allocator", "over", "plan",
           "error or note"]


class _Warnings(logging.Handler):
    """remat's warnings while a plan is made, for the row's note."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def run_arch(name: str, options: SolverOptions, modes=MODES, fraction: float = 0.5,
             least: bool = True, inductor: bool | Sequence[str] = False) -> list[Row]:
    """Both modes' rows for one architecture (a failure is a row with its error), each at the
    budget `fraction` of the way from its own mode's per-block checkpointing peak to its saving
    everything peak (`budget_range`), with both modes' least budgets where `least`; with
    `inductor`, both modes' rows and then the two Inductor rows of `examples.zoo_inductor`
    (remat's compile=True at the compiled row's budget, the eager plan compiled by
    torch.compile at the eager row's budget), or those of them it names."""
    family = ARCHS[name][0]
    if inductor:
        modes = MODES
    rows = [Row(name, family, mode) for mode in modes]
    plans = {}
    try:
        base, kwargs = build(name)
        reference = copy.deepcopy(base)
        training_step(reference, kwargs, seed=7)()  # eager PyTorch's gradients, same seed
        expected = gradients(reference)
        del reference
        prepared = prepare(copy.deepcopy(base), example_kwargs=kwargs)
    except Exception as e:  # the table reports every failure with its cause
        for row in rows:
            row.error = f"capture: {_first_line(e)}"
        return rows
    try:  # the eager step as the eager planner sees it (its probe runs a copy of the model)
        eager = eager_structure(copy.deepcopy(base), prepared, None, (), kwargs)[:2]
    except Exception as e:
        eager, eager_failure = None, f"eager blocks: {_first_line(e)}"
    if least:
        smallest = least_budgets(prepared, eager, options)
        for row in rows:
            (row.least_compiled, row.least_compiled_proven,
             row.least_eager, row.least_eager_proven) = smallest
    for row in rows:
        if row.mode == "eager" and eager is None:
            row.error = eager_failure
            continue
        row.blocks_peak, row.save_all_peak = budget_range(row.mode, prepared, eager)
        # A range that runs down (checkpointing holds more than saving everything) has its
        # least, per-block checkpointing, which every plan of the mode can meet.
        row.budget = max(int(row.blocks_peak + fraction * (row.save_all_peak - row.blocks_peak)),
                         row.blocks_peak)
        planned = copy.deepcopy(base)
        start = time.perf_counter()
        warnings = _Warnings()
        logging.getLogger("remat").addHandler(warnings)
        try:
            plan, call = _plan(row.mode, planned, prepared, kwargs, row.budget, options)
        except Exception as e:
            row.error = f"plan: {_first_line(e)}"
            if isinstance(e, BudgetError) and e.smallest is not None:
                row.error += f" (least {format_size(e.smallest)})"
            continue
        finally:
            row.plan_seconds = time.perf_counter() - start
            logging.getLogger("remat").removeHandler(warnings)
            if any("runs other code" in m for m in warnings.messages):
                row.note = "eager runs other code than captured (warned)"
        plans[row.mode] = plan
        row.status = plan.status.value
        row.gap = plan.gap
        bounded = plan.prepared.captured.graph_module.meta.get("remat_worst_case")
        if bounded and not row.note:
            row.note = (f"{len(bounded)} data-dependent sizes at their worst case "
                        "(every token to each expert)")
        row.predicted = plan.activation_peak
        try:
            step = training_step(call, kwargs, seed=7)
            # The first call compiles the planned step; Swin's second recompiles it once more
            # (an attribute its first forward sets), allocating in dynamo's tracer.
            for _ in range(2):
                step()
            row.allocator = activation_peak(step, planned)
            row.grad_diff = grad_diff(expected, planned)
        except Exception as e:
            row.error = f"run: {_first_line(e)}"
    if inductor:
        from examples.zoo_inductor import MODES as MODES_INDUCTOR, inductor_rows

        compiled, eager_row = rows
        rows += inductor_rows(name, family, base, kwargs, expected, compiled.budget or None,
                              plans.get("eager"), eager_row.budget or None, options,
                              only=MODES_INDUCTOR if inductor is True else tuple(inductor))
    return rows


def budget_range(mode: str, prepared, eager) -> tuple[int, int]:
    """The activations (simulated peak less the graph's gradients) that `mode` holds with every
    block checkpointed and nothing cached, and saving everything: the compiled graph's
    baselines, or remat's eager timeline of `eager` (problem, blocks) with every block
    checkpointed and with none (plain eager autograd: `pipeline_stage.ladder`'s low and
    high)."""
    grads = prepared.graph_gradients
    if mode == "compiled":
        return (prepared.baselines[Strategy.CHECKPOINT_BLOCKS].peak - grads,
                prepared.baselines[Strategy.SAVE_ALL].peak - grads)
    problem, blocks = eager
    unchecked = dataclasses.replace(blocks, ops={}, owner={}, packer={},
                                    cacheable=frozenset(), groups=())
    return (eager_schedule(problem, blocks, ()).peak - grads,
            eager_schedule(problem, unchecked, ()).peak - grads)


def least_budgets(prepared, eager, options: SolverOptions
                  ) -> tuple[int | None, bool, int | None, bool]:
    """Each mode's least activation budget and whether it is proven the least: compiled, the
    peak the exact solver names at budget 0 (its BudgetError's `smallest`); eager, the least
    eager peak of any per-block policy (`least_eager_peak`; None without the eager blocks).
    Each search has `options`' time limit."""
    grads = prepared.graph_gradients
    compiled, compiled_proven = None, False
    try:
        solve(prepared.problem, 0, Strategy.OPTIMAL, options)
    except BudgetError as e:
        if e.smallest is not None:
            compiled = e.smallest - grads
            compiled_proven = "(proven); recomputation cannot go lower" in str(e)
    if eager is None:
        return compiled, compiled_proven, None, False
    found, floor = least_eager_peak(*eager, options)
    return compiled, compiled_proven, found.peak - grads, floor >= found.peak


def _plan(mode: str, model, prepared, kwargs: dict, budget: int, options: SolverOptions):
    if mode == "compiled":
        plan = plan_prepared(model, prepared, budget=None, activation_budget=budget,
                             target="h100", solver_options=options)
        return plan, plan.module
    plan = plan_eager_mode(model, prepared, budget=None, activation_budget=budget,
                           target="h100", solver=Strategy.OPTIMAL, solver_options=options,
                           blocks=None, example_inputs=(), example_kwargs=kwargs)
    return plan, plan.apply(model)


def _first_line(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:200] if text else ''}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--archs", default=",".join(ARCHS),
                        help=f"comma-separated, from {', '.join(ARCHS)}")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--time-limit", type=float, default=10.0, help="seconds per solve")
    parser.add_argument("--fraction", type=float, default=0.5,
                        help="the budget's place between per-block checkpointing (0) and "
                             "saving everything (1)")
    parser.add_argument("--no-least", action="store_true",
                        help="skip the two least-budget searches (each --time-limit long)")
    parser.add_argument("--inductor", action="store_true",
                        help="add two rows per architecture: remat's compile=True at the "
                             "compiled budget, and torch.compile of the applied eager plan "
                             "(examples/zoo_inductor.py; a minute or more of compiles each)")
    parser.add_argument("--inductor-rows", help="with --inductor, only these of its rows "
                        "(comma-separated: inductor, eager+compile)")
    parser.add_argument("--out", help="also write the rows to this JSON file")
    parser.add_argument("-v", "--verbose", action="store_true", help="remat's INFO log")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.ERROR,
                        format="remat: %(message)s")
    logging.getLogger("remat").setLevel(logging.INFO if args.verbose else logging.WARNING)
    options = SolverOptions(time_limit=args.time_limit)
    rows: list[Row] = []
    for name in args.archs.split(","):
        new = run_arch(name, options, modes=args.modes.split(","), fraction=args.fraction,
                       least=not args.no_least,
                       inductor=args.inductor and (args.inductor_rows or "inductor,eager+compile")
                       .split(","))
        print(tabulate([r.cells() for r in new], tablefmt="plain", disable_numparse=True),
              flush=True)
        rows += new
        if args.out:
            Path(args.out).write_text(json.dumps([asdict(r) for r in rows], indent=1))
    print(f"\nThe zoo (CPU, fp32): transformers' tester configurations; each mode's budget "
          f"{args.fraction:g} of the way between its own per-block checkpointing and saving "
          "everything (blocks .. save all; where checkpointing holds more, checkpointing's); "
          "least = the least budget each mode's planner meets (* proven); "
          "predicted = the plan's activation "
          "peak, allocator = torch.profiler memory events less the state; over = allocator "
          "against predicted; gradients: max |planned - eager| over all parameters, relative to "
          "the largest |eager gradient|")
    print(tabulate([r.cells() for r in rows], headers=HEADERS, disable_numparse=True))
    ran = [r for r in rows if r.over is not None]
    above = [r for r in ran if r.allocator > r.predicted]
    print(f"\n{len(ran)} of {len(rows)} rows ran; {len(above)} above the prediction; "
          f"{sum(r.grad_diff != 0 for r in ran)} with gradients not bitwise equal")
    if args.inductor:
        from examples.zoo_inductor import summary

        print(summary(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
