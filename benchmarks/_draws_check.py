"""gpu_check's `draws` part: eager plans of a model with dropout, their gradients against eager
PyTorch's on the device.

Checkpoint replays the generator from a block's start, so a recomputed draw takes the numbers
of the first draw the recomputation makes: a block's random draws (on CUDA attention's dropout
and ``native_dropout``, both functional ops a policy may cache) are cached all or none. On
tests.models' GPT with dropout 0.1 after attention and MLP (two draws a block; attention's
own dropout is off: measuring its backward alone crashed the process on an H200, torch 2.11,
before the generator offsets were made on the CPU, which no GPU run has checked since),
planned eagerly at fractions of its plain eager peak: per plan, the largest gradient
difference from plain eager's step with the same seed, the blocks whose policy caches some of
their draws but not all (must be none), the allocator's activation peak against the plan's. The last row applies, by hand, a policy that
caches each block's first draw and recomputes the others (what the grouping rules out): its
gradients are expected to differ, which shows the check can tell.

    python benchmarks/gpu_check.py --checks draws
"""
from __future__ import annotations

import copy
from dataclasses import replace

import torch
from tabulate import tabulate

import remat
from remat.fx_passes.eager.apply import apply_eager
from remat.fx_passes.eager.call_guard import current
from remat.solvers import SolverOptions

MIB = 2**20
FRACTIONS = (0.9, 0.75, 0.6, 0.45)
# Gradients of the same step on the same device, recomputed or not: equal up to the order of
# floating-point sums in a recomputed kernel.
TOLERANCE = 1e-5


def random_positions(policy) -> list[int]:
    """The positions of `policy` that draw and that it may cache: its dropouts (attention,
    tagged random as well, draws nothing here), not the CPU's in-place ``bernoulli_``."""
    return [k for k, name in enumerate(policy.ops)
            if policy.cacheable[k] and "dropout" in name]


def grads(model, inputs, seed: int = 3) -> list[torch.Tensor]:
    for p in model.parameters():
        p.grad = None
    torch.manual_seed(seed)
    model(*inputs).backward()
    return [p.grad.detach().clone() for p in model.parameters()]


def largest_difference(got, want) -> float:
    scale = max(float(w.abs().max()) for w in want)
    return max(float((g - w).abs().max()) for g, w in zip(got, want)) / scale


def draws_part(device: str, time_limit: float, dry_run: bool) -> bool:
    """Prints the table; True when every plan's gradients equal eager's and no block caches
    part of its draws."""
    import inductor
    from tests.models import CausalSelfAttention, GPTConfig, gpt

    config = (GPTConfig(dropout=0.1) if dry_run else
              GPTConfig(block_size=256, vocab_size=1024, n_layer=4, n_head=4, n_embd=256,
                        dropout=0.1))
    model, inputs = gpt(config, batch=2 if dry_run else 8, device=device)
    for module in model.modules():  # attention draws nothing: two native_dropout a block
        if isinstance(module, CausalSelfAttention):
            module.dropout = 0.0
    reference = grads(copy.deepcopy(model), inputs)
    eager_peak, _ = inductor.measure(inductor.Case("gpt", copy.deepcopy(model), inputs, {}),
                                     copy.deepcopy(model))
    rows, ok, last = [], True, None
    for fraction in FRACTIONS:
        budget = int(fraction * eager_peak)
        try:
            plan = remat.optimize(copy.deepcopy(model), activation_budget=budget,
                                  example_inputs=inputs, execution="eager",
                                  solver_options=SolverOptions(time_limit=time_limit))
        except remat.BudgetError as e:
            rows.append([f"{fraction:.0%}", "", "", "", "", str(e).splitlines()[0][:100]])
            continue
        policies = {p: current(planned) for p, planned in plan.block_policies.items()}
        partial = [p for p, pol in policies.items()
                   if 0 < len(pol.cache.intersection(random_positions(pol)))
                   < len(random_positions(pol))]
        applied = plan.apply(copy.deepcopy(model))
        difference = largest_difference(grads(applied, inputs), reference)
        peak, _ = inductor.measure(inductor.Case("gpt", applied, inputs, {}), applied)
        good = difference <= TOLERANCE and not partial
        ok &= good
        cached = sum(bool(pol.cache.intersection(random_positions(pol)))
                     for pol in policies.values())
        rows.append([f"{fraction:.0%}", f"{cached}/{len(policies)}", f"{len(partial)}",
                     f"{difference:.1e}", f"{peak / MIB:.2f} / {plan.activation_peak / MIB:.2f}",
                     "ok" if good else "MISSED"])
        last = policies
    mixed = {}
    for p, pol in (last or {}).items():  # each block's first draw cached, later ones not
        if len(random_positions(pol)) > 1:
            first, *later = random_positions(pol)
            mixed[p] = replace(pol, cache=(pol.cache | {first}) - set(later))
    if mixed:
        applied = apply_eager(copy.deepcopy(model), {**last, **mixed})
        difference = largest_difference(grads(applied, inputs), reference)
        rows.append(["first draw cached, by hand", f"{len(mixed)}/{len(last)}",
                     f"{len(mixed)}", f"{difference:.1e}", "",
                     "differs, as expected" if difference > TOLERANCE else "equal"])
    print(tabulate(rows, headers=["budget / eager peak", "blocks caching draws",
                                  "blocks caching part", "grad difference / largest",
                                  "allocator / plan MiB", "check"], disable_numparse=True),
          flush=True)
    return ok
