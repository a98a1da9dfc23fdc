"""Fine-tuning with dynamic padding under one plan: GPT-2 (tiny config, nothing downloaded),
batches of random sizes and lengths, both execution modes.

    python benchmarks/shape_range.py [--steps 200] [--modes compiled,eager] [--fraction 0.6]

The data: `--steps` batches, each of 1..8 sequences of random lengths 8..128 (random token
ids), collated by transformers' `DataCollatorWithPadding` (right padding to the longest
sequence of the batch, with its attention mask; labels are the ids, -100 at padding). So the
shapes change at every step, as in a real fine-tuning job.

The plan: one `remat.optimize(model, activation_budget=B, dynamic={"batch": (1, 8),
"seq": (8, 128)}, execution=mode)` before the loop, from one example batch; B is `--fraction`
of the activations eager PyTorch holds at the largest shape (8 x 128), measured by the
allocator. Then every step runs the planned step and AdamW.

Every step is checked against independent references:
- gradients: eager PyTorch's, on the same weights, batch and seed (dropout on), compared
  bitwise (the largest difference is printed too);
- memory: the allocator's peak of the step (torch.profiler memory events,
  remat.fx_passes.measuring.allocator) less the gradients it leaves, i.e. the activations as
  `activation_budget` means them, against B.
The table: steps, distinct shapes, buckets planned (plans made), compilations during the run
(compiled mode: one per bucket used, never one per shape), planning seconds, the worst step's
allocator activations, the allocator's and the plan's activations at the range's largest shape
(what the range's proof says no step exceeds), the budget, and the gradient check.
"""
from __future__ import annotations

import argparse
import copy
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from tabulate import tabulate  # noqa: E402

import remat  # noqa: E402
from remat.fx_passes.measuring.allocator import step_peak  # noqa: E402
from remat.planner.job.budget import format_size  # noqa: E402

VOCAB, BATCH, SHORTEST, LONGEST = 128, 8, 8, 128
RANGE = {"batch": (1, BATCH), "seq": (SHORTEST, LONGEST)}


def tokenizer():
    """A word-level tokenizer over VOCAB tokens, built in memory (nothing downloaded)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {"[PAD]": 0, "[UNK]": 1, **{f"w{i}": i for i in range(2, VOCAB)}}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, "[UNK]")),
                                   pad_token="[PAD]", unk_token="[UNK]")


def batches(steps: int, seed: int = 0):
    """`steps` collated batches of random sizes and lengths."""
    from transformers import DataCollatorWithPadding

    collate = DataCollatorWithPadding(tokenizer(), return_tensors="pt")
    rng = random.Random(seed)
    for _ in range(steps):
        features = [{"input_ids": [rng.randrange(2, VOCAB)
                                   for _ in range(rng.randint(SHORTEST, LONGEST))]}
                    for _ in range(rng.randint(1, BATCH))]
        for f in features:
            f["attention_mask"] = [1] * len(f["input_ids"])
        batch = collate(features)
        batch["labels"] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
        yield dict(batch)


def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_positions=2 * LONGEST, n_embd=64, n_layer=2,
                        n_head=4, use_cache=False, pad_token_id=0)  # dropout 0.1
    return GPT2LMHeadModel(config).train()


def activations(step, model) -> int:
    """The allocator's peak of `step()` (forward, backward) less the gradients it leaves."""
    for p in model.parameters():
        p.grad = None
    peak, _ = step_peak(step, lambda out, seed: out.loss.backward(seed))
    return peak - sum(p.grad.numel() * p.grad.element_size() for p in model.parameters()
                      if p.grad is not None)


def largest_batch() -> dict:
    ids = torch.randint(2, VOCAB, (BATCH, LONGEST), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def run(mode: str, steps: int, fraction: float) -> list:
    model = gpt2()
    reference = copy.deepcopy(model)
    largest = largest_batch()
    eager_held = activations(lambda: reference(**largest), reference)
    budget = int(fraction * eager_held)
    example = next(batches(1, seed=99))
    start = time.perf_counter()
    plan = remat.optimize(model, activation_budget=budget, example_kwargs=example,
                          execution=mode, dynamic=RANGE,
                          solver_options=remat.solvers.SolverOptions(time_limit=10))
    planning = time.perf_counter() - start
    print(f"{mode}: planned in {planning:.1f} s: {plan!r}; eager activations at "
          f"{BATCH} x {LONGEST}: {format_size(eager_held)}, budget {format_size(budget)}",
          flush=True)
    for note in plan.report().notes[-len(plan.shapes.plans) - 1:]:
        print(f"  {note}")
    step_fn = plan.module if mode == "compiled" else plan.apply(model)
    # The planned step at the range's largest shape, with and without padding: the range's
    # claim is that no step holds more than this (the budget's, that this fits it).
    at_largest = max(activations(lambda: step_fn(**batch), model)
                     for batch in (largest, _with_padding(largest)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    shapes, worst, worst_shape, equal, largest_diff, over = set(), 0, None, 0, 0.0, 0
    for k, batch in enumerate(batches(steps)):
        shape = tuple(batch["input_ids"].shape)
        shapes.add(shape)

        def planned_step():
            torch.manual_seed(k)
            return step_fn(**batch)

        held = activations(planned_step, model)
        if held > worst:
            worst, worst_shape = held, shape
        over += held > budget
        reference.load_state_dict(model.state_dict())
        reference.zero_grad(set_to_none=True)
        torch.manual_seed(k)
        reference(**batch).loss.backward()
        diffs = [(p.grad - q.grad).abs().max().item()
                 for p, q in zip(model.parameters(), reference.parameters())]
        same = all(torch.equal(p.grad, q.grad)
                   for p, q in zip(model.parameters(), reference.parameters()))
        equal += same
        largest_diff = max(largest_diff, *diffs)
        optimizer.step()
        if (k + 1) % 50 == 0:
            print(f"{mode}: step {k + 1}: {len(shapes)} shapes so far, worst activations "
                  f"{format_size(worst)} of {format_size(budget)}", flush=True)
    compilations = len(step_fn.partitions) if mode == "compiled" else "-"
    return [mode, steps, len(shapes), len(plan.shapes.plans), compilations,
            f"{planning:.1f}", f"{format_size(worst)} at {worst_shape[0]} x {worst_shape[1]}",
            format_size(at_largest), format_size(plan.activation_peak), format_size(budget),
            f"{steps - over} / {steps}",
            f"{equal} / {steps} bitwise, max |diff| {largest_diff:.1e}"]


def _with_padding(batch: dict) -> dict:
    mask = batch["attention_mask"].clone()
    mask[-1, -1] = 0
    return {**batch, "attention_mask": mask,
            "labels": batch["labels"].masked_fill(mask == 0, -100)}


HEADERS = ["mode", "steps", "distinct shapes", "plans made", "compilations in the run",
           "planning s", "worst step: allocator activations", "allocator at 8 x 128",
           "plan at 8 x 128", "budget", "steps within budget", "gradients vs eager"]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--modes", default="compiled,eager")
    parser.add_argument("--fraction", type=float, default=0.6,
                        help="the activation budget, as a fraction of eager's at 8 x 128")
    args = parser.parse_args(argv)
    rows = [run(mode, args.steps, args.fraction) for mode in args.modes.split(",")]
    print(f"\nGPT-2 (tiny), {args.steps} steps of DataCollatorWithPadding batches (batch 1..8, "
          f"lengths 8..128), one plan for dynamic={RANGE}; allocator activations = "
          "torch.profiler memory events less the gradients")
    print(tabulate(rows, headers=HEADERS))


if __name__ == "__main__":
    main()
