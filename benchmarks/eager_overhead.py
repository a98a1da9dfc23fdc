"""The eager plan's own cost per training step, against Hugging Face's per-block
checkpointing at equal recompute FLOPs, on transformers models (the test configurations of
examples/zoo_models.py, larger batches so that a step is milliseconds, not microseconds).

    python benchmarks/eager_overhead.py [--archs qwen2,vit] [--repeat 20] [--batch 4]

Per model, each step is ``model(**batch).loss.backward()`` on the same batch, timed as the
median of `--repeat` steps after two warm-up steps, the columns interleaved step by step so
that a busy CPU slows them alike:
- eager: plain eager PyTorch, no checkpointing;
- HF per-block: ``model.gradient_checkpointing_enable({"use_reentrant": False})``, every
  decoder/encoder layer checkpointed (torch.utils.checkpoint, no policy);
- remat per-block: the eager plan's block policies (``remat.optimize(...,
  execution="eager")``) with nothing cached, applied (`apply_eager`): every op recomputed,
  the same recomputation as HF's. A policy that caches nothing runs its first call through
  selective checkpoint (its ops matched against the plan's) and later calls as plain
  checkpoint, so the difference from HF's column is remat's call checks;
- remat, one op cached a block: the same policies caching each block's last cacheable op:
  a policy that caches anything runs torch's selective checkpoint at every call, remat's
  per-op decision inside it;
- SAC, constant policy: the same blocks under torch's selective-checkpoint mode with a policy
  that answers PREFER_RECOMPUTE without looking: torch's own cost of a policy per op, which
  remat's column includes;
and per op the policy decides (in the forward and the recomputation): remat's decision
itself, timed directly (`remat.fx_passes.eager.selective.decider` called on each block's own
op sequence), what formatting the op's name costs (``canonical(str(op))``, which the decider
now caches per op), and torch's selective-checkpoint mode with a constant policy against
plain checkpoint ((SAC constant - HF per-block) / ops). The recompute FLOPs of the three checkpointed columns are
the same by construction: every block's forward once more (remat's policies cache nothing).
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from dataclasses import replace
from functools import partial

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from tabulate import tabulate  # noqa: E402

import remat  # noqa: E402
from examples.zoo_models import build  # noqa: E402
from remat.fx_passes.eager.apply import apply_eager  # noqa: E402
from remat.fx_passes.eager.block_policy import with_cache  # noqa: E402
from remat.fx_passes.tracing.dynamic import DimRange, InputDim, ShapeRange, resized  # noqa: E402


def batch_of(kwargs: dict, batch: int) -> dict:
    """The zoo's inputs tiled along dimension 0 to `batch` rows."""
    dims = tuple(InputDim(k, 0, "batch") for k, v in kwargs.items()
                 if isinstance(v, torch.Tensor) and v.dim() >= 1)
    return resized((), kwargs, ShapeRange((DimRange("batch", 1, 10**6),), dims),
                   {"batch": batch})[1]


def constant_sac(model: torch.nn.Module, paths: list[str]) -> torch.nn.Module:
    """`model` with each block in `paths` under torch's selective checkpoint with a policy
    that recomputes everything without looking at the op."""
    from torch.utils.checkpoint import (CheckpointPolicy, checkpoint,
                                        create_selective_checkpoint_contexts)

    def recompute(ctx, op, *args, **kwargs):
        return CheckpointPolicy.PREFER_RECOMPUTE

    for path in paths:
        module = model.get_submodule(path)
        forward = module.forward
        module.forward = partial(checkpoint, forward, use_reentrant=False, context_fn=partial(
            create_selective_checkpoint_contexts, recompute))
    return model


def decision_us(policies: dict, rounds: int = 200) -> tuple[float, float]:
    """(remat's policy function per op, formatting an op's name per op: what its name cache
    saves), in microseconds: `decider` called on each block's own op sequence, as the
    forward calls it, `rounds` times."""
    import itertools
    from types import SimpleNamespace

    from remat.fx_passes.eager.block_policy import canonical
    from remat.fx_passes.eager.selective import decider

    def resolve(name):
        _, packet, overload = name.split(".")
        return getattr(getattr(torch.ops.aten, packet), overload)

    sequences = [(policy, [resolve(n) for n in policy.ops]) for policy in policies.values()]
    forward = SimpleNamespace(is_recompute=False)
    count = sum(len(ops) for _, ops in sequences) * rounds
    start = time.perf_counter()
    for _ in range(rounds):
        for policy, ops in sequences:
            decide = decider(policy, itertools.count())
            for op in ops:
                decide(forward, op)
    decided = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(rounds):
        for _, ops in sequences:
            for op in ops:
                canonical(str(op))
    named = time.perf_counter() - start
    return 1e6 * decided / count, 1e6 * named / count


def step_of(model: torch.nn.Module, kwargs: dict):
    def step():
        model.zero_grad(set_to_none=True)
        torch.manual_seed(0)
        model(**kwargs).loss.backward()
    return step


def run(arch: str, batch: int, repeat: int) -> list:
    model, kwargs = build(arch)
    kwargs = batch_of(kwargs, batch)
    hf = copy.deepcopy(model)
    hf.gradient_checkpointing_enable({"use_reentrant": False})
    planned = copy.deepcopy(model)
    plan = remat.optimize(planned, activation_budget=10**12, example_kwargs=kwargs,
                          execution="eager")
    # Every block's policy with nothing cached but what it always keeps (routing
    # decisions): every block's forward recomputed, as HF's per-block checkpointing does.
    policies = {p: replace(with_cache(pol, frozenset()), training=True)
                for p, pol in plan.block_policies.items()}
    apply_eager(planned, policies)
    paths = list(policies)
    # The same blocks caching one op each (the last cacheable one: the block's output side):
    # a policy that caches anything runs torch's selective checkpoint at every call.
    selective = apply_eager(copy.deepcopy(model), {
        p: replace(pol, cache=frozenset(
            [k for k, ok in enumerate(pol.cacheable) if ok][-1:]) | pol.cache)
        for p, pol in policies.items()})
    sac = constant_sac(copy.deepcopy(model), paths)
    decided = sum(len(p.ops) for p in policies.values()) * 2  # forward + recomputation
    steps = {"eager": step_of(model, kwargs), "HF per-block": step_of(hf, kwargs),
             "SAC constant": step_of(sac, kwargs), "remat per-block": step_of(planned, kwargs),
             "remat one cached": step_of(selective, kwargs)}
    times: dict[str, list[float]] = {k: [] for k in steps}
    for k in range(repeat + 2):
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            if k >= 2:
                times[name].append(time.perf_counter() - start)
    ms = {name: 1e3 * statistics.median(t) for name, t in times.items()}
    per_op_us, naming_us = decision_us(policies)
    return [arch, f"{batch}", f"{ms['eager']:.1f}",
            f"{ms['HF per-block']:.1f} ({ms['HF per-block'] / ms['eager']:.2f}x)",
            f"{ms['SAC constant']:.1f} ({ms['SAC constant'] / ms['eager']:.2f}x)",
            f"{ms['remat per-block']:.1f} ({ms['remat per-block'] / ms['eager']:.2f}x)",
            f"{(ms['remat per-block'] / ms['HF per-block'] - 1) * 100:+.1f} %",
            f"{ms['remat one cached']:.1f} ({ms['remat one cached'] / ms['eager']:.2f}x)",
            f"{decided}", f"{per_op_us:.2f}", f"{naming_us:.2f}",
            f"{1e3 * (ms['SAC constant'] - ms['HF per-block']) / decided:.1f}"]


HEADERS = ["model", "batch", "eager ms", "HF per-block ms", "SAC constant ms",
           "remat per-block ms", "remat vs HF", "remat, one op cached a block, ms",
           "ops decided / step",
           "remat's decision us / op", "name formatting us / op (cached now)",
           "torch SAC mode us / op"]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--archs", default="qwen2,vit")
    parser.add_argument("--batch", type=int, default=4, help="batches of the zoo's inputs")
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # a shared CPU: one thread each, the columns interleaved
    rows = [run(arch, args.batch * 13, args.repeat) for arch in args.archs.split(",")]
    print(f"\nmedian of {args.repeat} steps, interleaved; one thread")
    print(tabulate(rows, headers=HEADERS))


if __name__ == "__main__":
    main()
