"""Real model sizes planned with default options, in both execution modes, on meta tensors.

    python benchmarks/real_sizes.py                         # every model, both modes
    python benchmarks/real_sizes.py --load 2                # beside 2 busy processes
    python benchmarks/real_sizes.py --models gpt2 llama-3.2-1b --modes eager
    python benchmarks/real_sizes.py --models mistral-7b --time-limit 71  # a report's advice

Each model is built from its published configuration, written out here with transformers'
config classes (nothing is downloaded), on meta tensors in bf16 and in train mode, and planned
for one rank under bf16-mixed AdamW, without sharding. The step is ``model(input_ids=...,
labels=...)`` at the sequence and batch of `configs`. As `remat.optimize` does it, the step is
prepared once (capture, profile, lower: replicated capture, since the weights are meta) and
each mode planned on it with the default `SolverOptions()` (limits chosen by the problem's
size, the solver's own). Both rows of a model therefore show the same capture.

The budget is a whole-step one where recomputation matters, each mode's own: the step's memory
with the mode's activation peak a quarter of the way from per-block checkpointing's to saving
everything's (`Prepared.needs`), rounded up to 0.1 GB. For the compiled mode these are the
`checkpoint_blocks` and `save_all` baselines; for the eager mode, the eager timeline of every
block checkpointed caching nothing and of no block checkpointed (the eager mode holds more with
the same policy, so one budget for both would test the eager mode nearer its floor). Mixtral
runs at batch 4: at batch 1 its activations are below its bf16 gradients of 46.7 B parameters,
which set the peak at the end of the backward whatever is recomputed (per-block checkpointing
95.6 GB against 100.6 GB saving everything at batch 2; 99.1 against 201.3 GB at batch 4).
Columns: ops of the problem the mode solved; capture, the capture's wall seconds;
prep, capture + profile + lower; solve, the solve's wall seconds (the eager rows add the probe
that derives the blocks' ops to it); call, the whole planning call (prep + probe + solve);
limit, the solver's limit chosen by size; status and gap of the plan; recompute, the
recomputation's predicted seconds on the target (H100) as a share of the step's op time, and
FLOPs, recomputed FLOPs as a share of the step's (counted FLOPs are matmuls and attention only,
so a plan that recomputes norms and pointwise ops shows 0); peak, the whole step's memory under
the plan (state included) against the budget. Timings are wall seconds and depend on the
machine's load: the header prints the load average after the run.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))


def configs() -> dict:
    """name -> (config, sequence, batch): the published shapes (hidden size, layers, heads,
    key/value heads, MLP width, vocabulary, rope base; Mixtral's experts, Gemma-2's head size,
    soft-capping and sliding window)."""
    from transformers import (Gemma2Config, GPT2Config, LlamaConfig, MistralConfig,
                              MixtralConfig, Phi3Config, Qwen2Config)

    common = dict(use_cache=False)
    return {
        "llama-3.2-1b": (LlamaConfig(
            vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
            num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0,
            max_position_embeddings=131072, tie_word_embeddings=True, **common), 4096, 1),
        "llama-3-8b": (LlamaConfig(
            vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
            num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0,
            max_position_embeddings=8192, **common), 4096, 1),
        "qwen2.5-7b": (Qwen2Config(
            vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
            num_attention_heads=28, num_key_value_heads=4, rope_theta=1000000.0,
            max_position_embeddings=32768, tie_word_embeddings=False, **common), 4096, 1),
        "mistral-7b": (MistralConfig(  # v0.3: no sliding window
            vocab_size=32768, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
            num_attention_heads=32, num_key_value_heads=8, rope_theta=1000000.0,
            sliding_window=None, max_position_embeddings=32768, **common), 4096, 1),
        "mixtral-8x7b": (MixtralConfig(
            vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
            num_attention_heads=32, num_key_value_heads=8, num_local_experts=8,
            num_experts_per_tok=2, rope_theta=1000000.0, sliding_window=None,
            max_position_embeddings=32768, **common), 4096, 4),
        "gemma-2-9b": (Gemma2Config(
            vocab_size=256000, hidden_size=3584, intermediate_size=14336, num_hidden_layers=42,
            num_attention_heads=16, num_key_value_heads=8, head_dim=256,
            query_pre_attn_scalar=256, sliding_window=4096, attn_logit_softcapping=50.0,
            final_logit_softcapping=30.0, max_position_embeddings=8192,
            attn_implementation="eager", **common), 4096, 1),
        "phi-3-mini": (Phi3Config(
            vocab_size=32064, hidden_size=3072, intermediate_size=8192, num_hidden_layers=32,
            num_attention_heads=32, num_key_value_heads=32, rope_theta=10000.0,
            max_position_embeddings=4096, **common), 4096, 1),
        "gpt2": (GPT2Config(n_layer=12, n_embd=768, n_head=12, vocab_size=50257,
                            n_positions=1024, attn_implementation="sdpa", **common), 1024, 8),
    }


MODELS = ("llama-3.2-1b", "llama-3-8b", "qwen2.5-7b", "mistral-7b", "mixtral-8x7b",
          "gemma-2-9b", "phi-3-mini", "gpt2")
MODES = ("compiled", "eager")


def build(name: str):
    """The model on meta tensors, bf16, train mode, and its step's keyword inputs."""
    import torch
    from transformers import AutoModelForCausalLM

    config, seq, batch = configs()[name]
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16).train()
    ids = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    return model, {"input_ids": ids, "labels": ids}, seq, batch


def budget_of(prepared, mode: str = "compiled", model=None, kwargs=None) -> int:
    """The whole-step budget with `mode`'s activation peak a quarter of the way from
    per-block checkpointing's to saving everything's, rounded up to 0.1 GB (the eager mode's
    from its own timeline: `model` and `kwargs` find its blocks)."""
    from remat.solvers import Strategy

    if mode == "eager":
        from remat.planner.plans.eager_plan import eager_structure
        from remat.solvers.timeline.eager import eager_schedule

        problem, structure, _, _ = eager_structure(model, prepared, None, None, kwargs)
        per_block = eager_schedule(problem, structure, ()).peak
        save_all = eager_schedule(problem, structure.unwrapped(), ()).peak
    else:
        per_block = prepared.baselines[Strategy.CHECKPOINT_BLOCKS].peak
        save_all = prepared.baselines[Strategy.SAVE_ALL].peak
    return math.ceil(prepared.needs(per_block + (save_all - per_block) // 4) / 1e8) * 100_000_000


def plan_mode(model, prepared, mode: str, budget: int, kwargs: dict,
              time_limit: float | None = None):
    """`remat.optimize`'s second half for `mode`, with the default options (but `time_limit`
    where one is given)."""
    from remat.planner.plans.eager_plan import plan_eager_mode
    from remat.planner.plans.plan import plan_prepared
    from remat.solvers import SolverOptions

    options = SolverOptions(time_limit=time_limit)
    if mode == "eager":
        return plan_eager_mode(model, prepared, budget=budget, activation_budget=None,
                               target="h100", solver="optimal", solver_options=options,
                               blocks=None, example_kwargs=kwargs)
    return plan_prepared(model, prepared, budget=budget, activation_budget=None, target="h100",
                         solver="optimal", solver_options=options)


def measure(name: str, modes, time_limit: float | None = None) -> list[dict]:
    """One row per mode for `name`."""
    from remat.errors import RematError
    from remat.planner.job.training import Training
    from remat.planner.plans.prepare import prepare

    model, kwargs, seq, batch = build(name)
    start = time.perf_counter()
    try:
        prepared = prepare(model, (), example_kwargs=kwargs,
                           training=Training(precision="bf16-mixed", optimizer="adamw"),
                           target="h100")
    except Exception as e:  # a row that says why, and the other models still run
        failed = {"model": name, "seq x batch": f"{seq}x{batch}", "budget": None,
                  "capture": time.perf_counter() - start, "prep": time.perf_counter() - start,
                  "traced": "-", "solve": 0.0, "call": time.perf_counter() - start,
                  "status": type(e).__name__, "error": str(e).splitlines()[0][:160]}
        return [dict(failed, mode=mode) for mode in modes]
    prep = time.perf_counter() - start
    phases = dict(prepared.phases)
    captured = prepared.captured
    base = {"model": name, "seq x batch": f"{seq}x{batch}",
            "capture": phases["capture"], "prep": prep,
            "traced": (f"{captured.traced_blocks}/{captured.blocks}"
                       if hasattr(captured, "traced_blocks") else "all"),
            "params": prepared.state.parameters}
    rows = []
    for mode in modes:
        budget = budget_of(prepared, mode, model, kwargs)
        row = dict(base, mode=mode, budget=budget)
        mark = time.perf_counter()
        try:
            plan = plan_mode(model, prepared, mode, budget, kwargs, time_limit)
        except RematError as e:
            row.update(solve=time.perf_counter() - mark, status=type(e).__name__,
                       error=str(e).splitlines()[0][:160])
        else:
            info = plan.schedule.info
            solved = plan.eager_problem if mode == "eager" else plan.problem
            row.update(ops=len(solved), solve=time.perf_counter() - mark,
                       status=plan.status.value, gap=plan.gap, limit=info.get("time_limit"),
                       recompute=100 * plan.schedule.cost / solved.total_cost,
                       flops=100 * plan.recompute_flops / solved.total_flops,
                       peak=plan.peak, last_resort=info.get("last_resort", ""))
        row["call"] = prep + row["solve"]
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    return rows


def table(rows: list[dict]) -> str:
    from tabulate import tabulate

    gb = lambda n: "-" if n is None else f"{n / 1e9:.1f}"  # noqa: E731
    body = [[r["model"], r["mode"], r["seq x batch"], r.get("ops", "-"), r["traced"],
             f"{r['capture']:.1f}", f"{r['prep']:.1f}", f"{r['solve']:.1f}", f"{r['call']:.1f}",
             "-" if r.get("limit") is None else f"{r['limit']:.1f}", r["status"],
             "-" if r.get("gap") is None else f"{100 * r['gap']:.2f} %",
             "-" if r.get("recompute") is None else f"{r['recompute']:.1f} %",
             "-" if r.get("flops") is None else f"{r['flops']:.1f} %",
             gb(r.get("peak")), gb(r["budget"])] for r in rows]
    return tabulate(body, headers=["model", "mode", "seq x batch", "ops", "traced",
                                   "capture s", "prep s", "solve s", "call s", "limit s",
                                   "status", "gap", "recompute", "FLOPs", "peak GB",
                                   "budget GB"],
                    disable_numparse=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--load", type=int, default=0,
                        help="busy processes (spin loops) to run beside the planning")
    parser.add_argument("--time-limit", type=float, default=None,
                        help="the solver's time limit (default: SolverOptions' own, by size)")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from _load import busy

    rows: list[dict] = []
    with busy(args.load):
        for name in args.models:
            rows.extend(measure(name, args.modes, args.time_limit))
        load = os.getloadavg()[0]
    options = ("default SolverOptions" if args.time_limit is None
               else f"SolverOptions(time_limit={args.time_limit:g})")
    print(f"{options}, {os.cpu_count()} CPUs, {args.load} busy processes beside, "
          f"load average {load:.1f}")
    print(table(rows))
    for row in rows:
        if row.get("error") or row.get("last_resort"):
            print(f"{row['model']} {row['mode']}: {row.get('error') or row['last_resort']}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(rows, out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
