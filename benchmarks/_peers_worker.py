"""One model of `peers.py`, in its own process: every strategy, every budget, as JSON.

Run by peers.py; by hand: python benchmarks/_peers_worker.py MODEL OUT.json [--quick]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import time
import traceback
from dataclasses import dataclass

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]

import torch  # noqa: E402

from _peers_measure import Measured, compare_grads  # noqa: E402
from _peers_models import MODELS  # noqa: E402
from _peers_strategies import Case, Remat, eager, torch_budget  # noqa: E402
from remat.errors import RematError  # noqa: E402


@dataclass(frozen=True)
class Settings:
    quick: bool
    fractions: tuple[float, ...]  # the grid of activation_memory_budget values tried
    bisect_steps: int  # further halvings toward each budget's largest fitting fraction
    budgets: int  # evenly spaced budgets (the baselines' peaks are added to them)
    repeats: int  # timed steps per configuration
    time_limit: float  # seconds for the exact solver per budget

    @staticmethod
    def of(quick: bool) -> "Settings":
        # Sized so that the default run (six models) ends in about ten minutes on two CPU
        # cores: a few seconds of solver per budget (SolverOptions sizes its other limits by
        # the problem), six spaced budgets besides the baselines' peaks, one timed step.
        if quick:
            return Settings(True, (0.0, 0.5, 1.0), 1, 5, 1, 3.0)
        return Settings(False, (0.0, 0.25, 0.5, 0.75, 1.0), 1, 6, 1, 5.0)


# Seconds for each proven bound (remat.solvers.relaxation.bound), all its CP-SAT solves (one per
# backward step tried) together.
BOUND_SECONDS = 10.0


class Worker:
    def __init__(self, case: Case, settings: Settings):
        self.case = case
        self.s = settings
        self.rows: list[dict] = []
        self.reference: Measured | None = None
        self.torch_runs: dict[float, dict] = {}

    # -- recording
    def row(self, strategy: str, measured: Measured | None = None, **fields) -> dict:
        row = {"strategy": strategy, **fields}
        if measured is not None:
            grads, diff = compare_grads(measured.grads, self.reference.grads)
            row.update(peak=measured.peak, flops=measured.flops,
                       recompute=measured.flops - self.reference.flops, grads=grads,
                       max_grad_diff=diff, seconds=measured.seconds,
                       graph_calls=measured.graph_calls)
        self.rows.append(row)
        shown = {k: row[k] for k in ("param", "budget", "chosen", "peak", "recompute", "grads",
                                      "seconds", "error") if k in row}
        print(f"  {self.case.name} {strategy} {shown}", flush=True)
        return row

    def attempt(self, strategy: str, fn, **fields) -> dict:
        try:
            measured, extra = fn()
        except Exception as e:  # a strategy that fails on a model is a result, not a crash
            # Dynamo wraps a backend's error in "backend=... raised:"; the cause is the next line.
            reason = next((line for line in str(e).splitlines()
                           if line.strip() and not line.rstrip().endswith("raised:")),
                          type(e).__name__)
            logging.debug("%s failed", strategy, exc_info=True)
            return self.row(strategy, error=f"{type(e).__name__}: {reason[:200]}", **fields)
        return self.row(strategy, measured, **extra, **fields)

    # -- strategies
    def eager_all(self) -> None:
        self.reference, how = eager(self.case, "none", self.s.repeats)
        self.row("none", self.reference, how=how)
        for name in ("per_block", "chen_sqrt"):
            if name == "chen_sqrt" and not self.case.chain:
                continue  # measured through remat's chen_sqrt schedule instead, below
            self.attempt(name, lambda: _with_how(eager(self.case, name, self.s.repeats)))

    def torch_at(self, fraction: float) -> dict:
        fraction = round(fraction, 4)
        if fraction not in self.torch_runs:
            self.torch_runs[fraction] = self.attempt(
                "torch_budget", lambda: (torch_budget(self.case, fraction, self.s.repeats), {}),
                param=fraction, how="activation_memory_budget (min-cut partitioner, op by op)")
        return self.torch_runs[fraction]

    def torch_for(self, budget: int) -> dict | None:
        """The largest fraction whose measured peak fits: the largest on the grid, then halving
        toward the next grid value (the peak is not monotone in the fraction, so the grid comes
        first and the halvings only refine its answer)."""
        def fits(f):
            run = self.torch_at(f)
            return "peak" in run and run["peak"] <= budget

        grid = sorted(self.s.fractions)
        fitting = [f for f in grid if fits(f)]
        if not fitting:
            return None
        low = fitting[-1]
        above = [f for f in grid if f > low]
        if above:
            high = above[0]
            for _ in range(self.s.bisect_steps):
                mid = (low + high) / 2
                low, high = (mid, high) if fits(mid) else (low, mid)
        return self.torch_at(low)


def _with_how(result):
    measured, how = result
    return measured, {"how": how}


def proven_bounds(problem, rows: list[dict]) -> dict:
    """What no schedule of remat's execution model (the traced op order, recomputations
    inserted) can beat, from remat.solvers.relaxation.bound: the least activation peak, and the
    least recompute FLOPs at per-block checkpointing's measured peak. Independent of remat's search,
    so a check that remat fails can be told apart from a check that nothing can pass."""
    from remat.solvers.relaxation.bound import peak_bound, recompute_bound

    floor = peak_bound(problem, time_limit=BOUND_SECONDS)
    found = {"peak": floor.value, "peak_exact": floor.exact,
             "peak_at": floor.where(problem) if floor.steps else None}
    block = next((r for r in rows if r["strategy"] == "per_block" and "peak" in r), None)
    if block is not None:
        flops = recompute_bound(problem, block["peak"], cost=lambda op: op.flops,
                                time_limit=BOUND_SECONDS)
        found.update(per_block_peak=block["peak"], flops_at_per_block=flops.value,
                     flops_exact=flops.exact,
                     flops_at=flops.where(problem) if flops.steps else None)
    print(f"  proven bounds: {found}", flush=True)
    return found


def _budgets(lo: int, hi: int, n: int, extra: list[int]) -> list[int]:
    spaced = [lo + (hi - lo) * i // (n - 1) for i in range(n)] if hi > lo else [lo]
    return sorted(set(spaced) | {b for b in extra if lo <= b <= hi})


def run(name: str, quick: bool, time_limit: float | None = None) -> dict:
    settings = Settings.of(quick)
    if time_limit is not None:
        settings = dataclasses.replace(settings, time_limit=time_limit)
    started = time.perf_counter()
    case = MODELS[name](quick)
    w = Worker(case, settings)
    w.eager_all()
    for f in settings.fractions:
        w.torch_at(f)

    remat = Remat(case, time_limit=settings.time_limit)

    def schedule(solver: str, budget: int = 1 << 60, **fields):
        def go():
            r = remat.run(budget, settings.repeats, solver)
            return r.measured, {"predicted": r.predicted, "status": r.status, "gap": r.gap,
                                **fields}
        return go

    if not case.chain:
        w.attempt("chen_sqrt", schedule(
            "chen_sqrt", how="remat's chen_sqrt schedule run by remat's rewrite (the blocks "
                             "are not a chain)"))
    # Not a competitor: remat's own per-block schedule, through remat's rewrite. Set beside
    # torch.utils.checkpoint's measured peak, it tells the solver's losses from the execution
    # model's.
    w.attempt("remat_blocks", schedule("checkpoint_blocks"))
    try:
        smallest = remat.smallest()
    except RematError as e:  # the search for the least peak stopped with nothing: say so
        print(f"  {name}: remat's smallest peak unknown: {e}", flush=True)
        smallest = None
    peaks = [r["peak"] for r in w.rows if "peak" in r and r["strategy"] != "remat_blocks"]
    lo, hi = min(peaks + ([smallest] if smallest else [])), w.reference.peak
    baseline_peaks = [r["peak"] for r in w.rows if r["strategy"] in ("per_block", "chen_sqrt")
                      and "peak" in r]
    budgets = _budgets(lo, hi, settings.budgets, baseline_peaks)
    bounds = proven_bounds(remat.prepared.problem, w.rows)
    for budget in budgets:
        w.attempt("remat", schedule("optimal", budget), budget=budget)
        chosen = w.torch_for(budget)
        w.row("torch_budget@budget", budget=budget,
              chosen=None if chosen is None else chosen["param"])
    return {"model": name, "quick": quick, "time_limit": settings.time_limit,
            "rows": w.rows, "budgets": budgets,
            "remat_smallest": smallest, "save_all_peak": w.reference.peak, "bounds": bounds,
            "step_flops": w.reference.flops, "seconds": time.perf_counter() - started,
            "torch": torch.__version__,
            "params": sum(p.numel() for p in case.model.parameters()),
            "inputs": [list(x.shape) for x in case.inputs]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model", choices=sorted(MODELS))
    parser.add_argument("out")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--time-limit", type=float)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    try:
        result = run(args.model, args.quick, args.time_limit)
    except Exception:
        result = {"model": args.model, "quick": args.quick, "crash": traceback.format_exc()}
        print(result["crash"], file=sys.stderr)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
