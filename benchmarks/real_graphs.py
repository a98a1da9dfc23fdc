"""The solver on real graphs: Hugging Face architectures of the zoo (`examples/zoo_models.py`,
tiny configurations) captured, their compiled problems saved, and each solved at shares of its
save-all peak with the solver's default options (limits by size) or `--time-limit`.

    python benchmarks/real_graphs.py --save /tmp/problems              # capture, save, solve
    python benchmarks/real_graphs.py --load-problems /tmp/problems --fractions 0.6 --archs mamba
    python benchmarks/real_graphs.py --archs whisper,deberta --load 2  # beside 2 busy processes

A row per architecture and budget: ops, the budget (a share of the save-all activation peak
that `simulate` gives), the solve's wall seconds over its limit, status, cost and bound
(recompute seconds on the target), the gap ((cost - bound) / cost) and where the bound came
from. The problem files (`remat.solvers.core.problem_file`, with the save-all peak) are what
`--load-problems` reads back, for solving again without capturing.
"""
from __future__ import annotations

import argparse
import copy
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

ARCHS = ("gpt2", "bert", "llama", "t5", "whisper", "deberta", "mamba", "electra", "jamba")
ALIASES = {"deberta": "deberta_v2"}  # the zoo's name


def whisper():
    """WhisperForConditionalGeneration as WhisperModelTester builds it (not in the zoo: its
    input is a spectrogram): 80 mel bins over 60 frames, d_model 16, 2 + 2 layers of 4 heads,
    FFN 16, dropout 0.1, target ids as labels."""
    import torch
    import transformers

    config = transformers.WhisperConfig(
        vocab_size=200, num_mel_bins=80, d_model=16, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=16,
        decoder_ffn_dim=16, max_source_positions=30, max_target_positions=40, dropout=0.1,
        attention_dropout=0.1, pad_token_id=0, bos_token_id=198, eos_token_id=98,
        decoder_start_token_id=85, use_cache=False)
    g = torch.Generator().manual_seed(1234)
    model = transformers.WhisperForConditionalGeneration(config).train()
    features = torch.randn(13, 80, 60, generator=g)
    labels = torch.randint(3, 200, (13, 7), generator=g)
    return model, {"input_features": features, "labels": labels}


def capture(name: str):
    """The compiled problem of the zoo's `name` (or `whisper`), as `remat.optimize` lowers it."""
    from examples.zoo_models import build
    from remat.planner.plans.prepare import prepare

    model, kwargs = whisper() if name == "whisper" else build(ALIASES.get(name, name))
    return prepare(copy.deepcopy(model), example_kwargs=kwargs).problem


def problems(args) -> list[tuple[str, object]]:
    from remat.solvers.core.problem_file import dumps, loads

    found = []
    for name in args.archs.split(","):
        if args.load_problems:
            found.append((name, loads(Path(args.load_problems, f"{name}.json").read_text())[0]))
            continue
        problem = capture(name)
        if args.save:
            Path(args.save).mkdir(parents=True, exist_ok=True)
            Path(args.save, f"{name}.json").write_text(dumps(problem))
        found.append((name, problem))
    return found


def solve_row(name: str, problem, fraction: float, time_limit: float | None) -> list:
    from remat.errors import BudgetError, SolverError
    from remat.solvers import SolverOptions, make_schedule, simulate, solve

    save_all = simulate(problem, make_schedule(problem, ())).peak
    budget = int(fraction * save_all)
    options = SolverOptions(time_limit=time_limit)
    limit = options.by_size(len(problem)).time_limit
    began = time.perf_counter()
    try:
        plan = solve(problem, budget, "optimal", options)
    except (BudgetError, SolverError) as e:
        return [name, len(problem), f"{fraction:.0%}", f"{time.perf_counter() - began:.1f}/"
                f"{limit:g}", type(e).__name__, "-", "-", "-", str(e).splitlines()[0][:60]]
    wall = time.perf_counter() - began
    return [name, len(problem), f"{fraction:.0%}", f"{wall:.1f}/{limit:g}", plan.status.value,
            f"{plan.cost:.4g}", f"{plan.bound:.4g}", f"{plan.gap:.2%}",
            plan.info.get("bound_from", "")]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--archs", default=",".join(ARCHS))
    parser.add_argument("--fractions", default="0.75,0.6",
                        help="budgets, as shares of each problem's save-all peak")
    parser.add_argument("--time-limit", type=float, default=None,
                        help="seconds per solve (default: the solver's, by problem size)")
    parser.add_argument("--save", help="write each captured problem to DIR/<arch>.json")
    parser.add_argument("--load-problems", metavar="DIR",
                        help="solve the problems saved in DIR instead of capturing")
    parser.add_argument("--load", type=int, default=0,
                        help="busy processes (spin loops) beside the solves")
    args = parser.parse_args(argv)
    from tabulate import tabulate

    from _load import busy

    found = problems(args)
    rows = []
    with busy(args.load):
        start = os.getloadavg()[0]
        for name, problem in found:
            for fraction in (float(f) for f in args.fractions.split(",")):
                rows.append(solve_row(name, problem, fraction, args.time_limit))
                print(" ".join(map(str, rows[-1])), file=sys.stderr, flush=True)
        end = os.getloadavg()[0]
    limits = ("default options (limits by size)" if args.time_limit is None
              else f"time limit {args.time_limit:g} s")
    print(f"{limits}, {args.load} busy processes beside, {os.cpu_count()} CPUs, load average "
          f"{start:.1f} -> {end:.1f}")
    print(tabulate(rows, headers=["arch", "ops", "budget", "wall/limit s", "status", "cost",
                                  "bound", "gap", "bound from"], disable_numparse=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
