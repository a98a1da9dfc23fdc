"""Hugging Face transformers models as they are, planned at 50 % and 25 % of eager's activations.

    python examples/hf_zoo.py                              # every model, 20 s per solve
    python examples/hf_zoo.py --models gpt2,bert --time-limit 10 --fractions 0.5

Each model is built from a tiny configuration (nothing is downloaded), in train mode with
dropout on where the architecture has it, and called as a training loop calls it:
``model(input_ids=..., labels=...)`` (``pixel_values`` for ViT). remat plans it without a
wrapper: ``remat.optimize(model, example_kwargs={...}, activation_budget=...)``; the planned
module returns the model's ``ModelOutput`` and ``out.loss.backward()`` runs the plan.

For each model the reference is eager PyTorch's step, measured by the allocator
(remat.fx_passes.measuring.allocator: torch.profiler memory events on the CPU, every byte allocated from
the start of the forward to the end of the backward). Its activations mean what
``activation_budget`` means: the step's peak less the state (parameters, which the allocator
sees as held before the step, and their gradients; there is no optimizer here). Each budget is
a fraction of eager's activations. Per model and budget the table prints: whether the budget
is shown feasible before planning (per-block checkpointing fits it, or the proven floor of the
least peak exceeds it), capture (seconds, or the error), the solver's status, time and gap, the
largest gradient difference to eager (same seed: dropout is replayed), the plan's predicted
activation peak and the allocator's (the planned step's peak less its gradients) against the
budget, and the recompute FLOPs in % of the model's.
"""
from __future__ import annotations

import argparse
import copy
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from remat.errors import BudgetError  # noqa: E402
from remat.fx_passes.measuring.allocator import allocator_peak  # noqa: E402
from remat.planner.budget import format_size  # noqa: E402
from remat.planner.plan import plan_prepared  # noqa: E402
from remat.planner.prepare import prepare  # noqa: E402
from remat.solvers import SolverOptions, Strategy  # noqa: E402
from remat.solvers.bound import peak_bound  # noqa: E402

VOCAB, SEQ, BATCH = 128, 128, 8
SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, max_position_embeddings=256)


def _decoder(config_cls: str, model_cls: str, **fields) -> Callable:
    def build():
        import transformers

        config = getattr(transformers, config_cls)(**{**SMALL, **fields})
        config.use_cache = False  # training: a KV cache would be returned and held
        return getattr(transformers, model_cls)(config), _lm_batch()
    return build


def _lm_batch(labels: bool = True) -> dict:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return {"input_ids": ids, "labels": ids} if labels else {"input_ids": ids}


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=VOCAB, n_positions=256, n_embd=64, n_layer=2, n_head=4,
                        use_cache=False)  # dropout 0.1 by default
    return GPT2LMHeadModel(config), _lm_batch()


def _bert():
    from transformers import BertConfig, BertForMaskedLM

    return BertForMaskedLM(BertConfig(**SMALL)), _lm_batch()  # hidden dropout 0.1


def _t5():
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=2,
                      num_heads=4, use_cache=False, decoder_start_token_id=0,
                      pad_token_id=0)  # dropout 0.1; labels shift right from token 0
    return T5ForConditionalGeneration(config), _lm_batch()


def _vit():
    from transformers import ViTConfig, ViTForImageClassification

    config = ViTConfig(image_size=64, patch_size=8, hidden_size=64, num_hidden_layers=2,
                       num_attention_heads=4, intermediate_size=128, num_labels=10,
                       hidden_dropout_prob=0.1)
    g = torch.Generator().manual_seed(1)
    return ViTForImageClassification(config), {
        "pixel_values": torch.randn(BATCH, 3, 64, 64, generator=g),
        "labels": torch.randint(0, 10, (BATCH,), generator=g)}


MODELS: dict[str, tuple[str, Callable]] = {
    "gpt2": ("decoder", _gpt2),
    "llama": ("decoder", _decoder("LlamaConfig", "LlamaForCausalLM", num_key_value_heads=2)),
    "mistral": ("decoder", _decoder("MistralConfig", "MistralForCausalLM",
                                    num_key_value_heads=2)),
    "qwen2": ("decoder", _decoder("Qwen2Config", "Qwen2ForCausalLM", num_key_value_heads=2)),
    "gpt_neox": ("decoder", _decoder("GPTNeoXConfig", "GPTNeoXForCausalLM",
                                     hidden_dropout=0.1, attention_dropout=0.1)),
    "opt": ("decoder", _decoder("OPTConfig", "OPTForCausalLM", ffn_dim=128,
                                word_embed_proj_dim=64, dropout=0.1)),
    "bert": ("encoder", _bert),
    "t5": ("encoder-decoder", _t5),
    "vit": ("vision", _vit),
    "mixtral": ("MoE", _decoder("MixtralConfig", "MixtralForCausalLM", num_key_value_heads=2,
                                num_local_experts=4, num_experts_per_tok=2)),
    "qwen2_moe": ("MoE", _decoder("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                                  num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                                  moe_intermediate_size=64, shared_expert_intermediate_size=64)),
}


def build(name: str):
    torch.manual_seed(0)
    model, kwargs = MODELS[name][1]()
    return model.train(), kwargs


# ----------------------------------------------------------------------------- measuring


def gradient_bytes(model: torch.nn.Module) -> int:
    """Bytes of the parameters' gradients after a step: part of the state, which the one
    meaning of activations takes out of the step's peak (remat.planner.accounting)."""
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


def grad_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    worst = 0.0
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        if (p.grad is None) != (q.grad is None):
            return float("inf")
        if p.grad is not None:
            worst = max(worst, (p.grad - q.grad).abs().max().item())
    return worst


def zero(model: torch.nn.Module) -> None:
    for p in model.parameters():
        p.grad = None


# ----------------------------------------------------------------------------- the table


@dataclass
class Row:
    model: str
    family: str
    fraction: float
    budget: int = 0
    capture: str = ""
    status: str = ""
    solve_time: float | None = None
    gap: float | None = None
    grad_diff: float | None = None
    predicted: int | None = None
    peak: int | None = None
    recompute_pct: float | None = None
    feasible: str = ""
    error: str = ""

    def cells(self) -> list:
        fits = "" if self.peak is None else ("yes" if self.peak <= self.budget else "NO")
        return [self.model, self.family, f"{100 * self.fraction:.0f} %",
                format_size(self.budget) if self.budget else "", self.feasible, self.capture,
                self.status or self.error.split(":")[0],
                "" if self.solve_time is None else f"{self.solve_time:.1f} s",
                "" if self.gap is None else f"{100 * self.gap:.2f} %",
                "" if self.grad_diff is None else f"{self.grad_diff:.1e}",
                "" if self.predicted is None else format_size(self.predicted),
                "" if self.peak is None else format_size(self.peak), fits,
                "" if self.recompute_pct is None else f"{self.recompute_pct:.1f} %"]


HEADERS = ["model", "family", "budget", "activations", "feasible", "capture", "status", "solve",
           "gap", "grad diff", "predicted", "allocator", "fits", "recompute"]


def feasibility(prepared, budget: int, seconds: float) -> tuple[str, int]:
    """Whether `budget` (activations) is shown feasible before planning: "blocks" when
    per-block checkpointing fits it; else "no" when the proven least peak (bound.peak_bound,
    a floor no schedule beats) exceeds it; else "open" (the solver decides). Also the floor."""
    grads = prepared.graph_gradients
    blocks = prepared.baselines[Strategy.CHECKPOINT_BLOCKS].peak - grads
    floor = max(0, int(peak_bound(prepared.problem, time_limit=seconds).value) - grads)
    if blocks <= budget:
        return "blocks", floor
    return ("no" if floor > budget else "open"), floor


def run_model(name: str, fractions: list[float], options: SolverOptions) -> list[Row]:
    family = MODELS[name][0]
    try:
        base, kwargs = build(name)
        eager = copy.deepcopy(base)
        eager_step = training_step(eager, kwargs, seed=7)
        eager_step()  # first call: lazy initialization outside the measured step
        eager_activations = activation_peak(eager_step, eager)
    except Exception as e:
        return [Row(name, family, f, capture="no eager step", error=_first_line(e))
                for f in fractions]
    print(f"{name}: eager activations {format_size(eager_activations)} (allocator, "
          f"gradients {format_size(gradient_bytes(eager))} out)", flush=True)
    start = time.perf_counter()
    try:
        prepared = prepare(base, example_kwargs=kwargs)
    except Exception as e:  # the table reports every failure with its cause
        return [Row(name, family, f, int(f * eager_activations), capture="failed",
                    error=_first_line(e)) for f in fractions]
    capture = f"ok {time.perf_counter() - start:.0f} s"
    grads = prepared.graph_gradients
    simulated = {s.value: format_size(v.peak - grads) for s, v in prepared.baselines.items()}
    print(f"{name}: captured; simulated activation peaks {simulated}", flush=True)
    rows = []
    for fraction in fractions:
        row = Row(name, family, fraction, int(fraction * eager_activations), capture=capture)
        rows.append(row)
        row.feasible, floor = feasibility(prepared, row.budget, min(5.0, options.time_limit))
        planned = copy.deepcopy(base)
        try:
            plan = plan_prepared(planned, prepared, budget=None, activation_budget=row.budget,
                                 target="h100", solver_options=options)
        except Exception as e:
            row.error = _first_line(e)
            if isinstance(e, BudgetError) and e.smallest is not None:
                row.error += f" (least peak found {format_size(e.smallest)}, " \
                             f"floor {format_size(floor)})"
            print(f"{name} at {100 * fraction:.0f} %: {row.error}", flush=True)
            continue
        row.status, row.solve_time, row.gap = plan.status.value, plan.schedule.solve_time, \
            plan.gap
        row.predicted = plan.activation_peak
        row.recompute_pct = plan.report().price.recompute_pct
        try:
            step = training_step(plan.module, kwargs, seed=7)
            step()  # compiles the planned step
            row.peak = activation_peak(step, planned)
            row.grad_diff = grad_diff(eager, planned)
        except Exception as e:
            row.error = f"run: {_first_line(e)}"
        print(tabulate([row.cells()], headers=HEADERS, disable_numparse=True), flush=True)
    return rows


def _first_line(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:150] if text else ''}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS),
                        help=f"comma-separated, from {', '.join(MODELS)}")
    parser.add_argument("--fractions", default="0.5,0.25",
                        help="budgets as fractions of eager's measured activation peak")
    parser.add_argument("--time-limit", type=float, default=20.0, help="seconds per solve")
    parser.add_argument("-v", "--verbose", action="store_true", help="remat's INFO log")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="remat: %(message)s")
    fractions = [float(f) for f in args.fractions.split(",")]
    options = SolverOptions(time_limit=args.time_limit)
    rows = []
    for name in args.models.split(","):
        rows += run_model(name, fractions, options)
    print("\nHugging Face models as they are (CPU, fp32). activations = the step's peak less "
          "the state (parameters, gradients; no optimizer), budgets a fraction of eager's; "
          "feasible: blocks = per-block checkpointing fits, no = the proven floor exceeds it, "
          "open = neither shows it; predicted = the plan's simulated activation peak, "
          "allocator = torch.profiler memory events less the gradients; grad diff = "
          "max |planned - eager| over all parameter gradients)")
    print(tabulate([r.cells() for r in rows], headers=HEADERS, disable_numparse=True))
    failures = [r for r in rows if r.error]
    for r in failures:
        print(f"  {r.model} at {100 * r.fraction:.0f} %: {r.error}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
