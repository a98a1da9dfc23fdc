"""remat's eager plans against PyTorch's AutoSAC, under FSDP2 on 2 gloo ranks (CPU).

    pip install -e .[bench]     # pulp and pwlf: torch.distributed._tools' AutoSAC needs them
    python benchmarks/sharded.py [--layers 4] [--dropout 0.1] [--time-limit 10]

A small Llama-style model (examples/llama.py's `tiny_llama`: RMSNorm, rotary, SDPA, SwiGLU, dropout) is
trained for one step per configuration, twice: with dropout, and with dropout 0. The
configurations: no checkpointing; `torch.utils.checkpoint` on every block; PyTorch's AutoSAC
(benchmarks/_autosac.py: SACEstimator and its companions' statistics, `sac_milp` at a budget in
GiB per rank, `get_optimal_checkpointing_policy_per_module`, applied with checkpoint and
`create_selective_checkpoint_contexts`) at three budgets; and remat
(`remat.optimize(..., budget=, training=Training(data_parallel=2, zero_stage=3),
execution="eager")`, then what `plan.apply` runs after its checks:
`apply_eager(model, plan.block_policies)`, on each rank) at the same three budgets.

The budgets: `sac_milp`'s smallest solvable budget plus 10, 50 and 90 % of the way to its own
estimate of the step without checkpointing (`--fractions`). Both planners are given the same
bytes: the per-rank step of forward and backward, sharded parameters and gradients included, no
optimizer state (SGD, which keeps none, and nothing reserved or left for fragmentation).
remat's eager mode may not yet model FSDP2's gathered parameters (it then logs a warning);
sac_milp never does (its memory model leaves them out).

Per configuration and rank, under `fully_shard` on every block and the root (one block of
explicit prefetch, as FSDP2 overlaps on a GPU):
- rank peak: the bytes held before the step (each rank's parameter shards and batch) plus the
  allocator's peak above them during forward and backward (torch.profiler memory events,
  every free counted, tests/allocator.py), the least of five steps. Between runs on a loaded
  machine one rank's reading moved once by 166 KB (checkpoint every block); AutoSAC's rows
  move more, because sac_milp (CBC, 5 % gap) picks among equally cheap blocks differently
  from run to run (which blocks the notes list), and remat's lowest budget moves with what
  CP-SAT finds in its time limit;
- FSDPMemTracker: `torch.distributed._tools.fsdp2_mem_tracker`'s peak of the same step, per rank;
- gradients: each rank's gradient shards against the same rank's step without checkpointing
  (rel 1e-5), dropout drawn from the same seed;
- recompute GFLOP: FlopCounterMode on one process (the step's FLOPs minus those of the step
  without checkpointing; attention counted with remat's CPU formulas);
- planned: the peak each planner claims per rank: sac_milp's `max_m` (a bound the solver
  leaves at the budget), or remat's `plan.peak`.
A configuration that fails shows its error in the table. AutoSAC's runtime estimators are
CUDA-only: a roofline with remat's H100 figures stands in for them (see _autosac.py, which
also names the one other change: module orders deduplicated for a module called twice).
Timing-free: only bytes and FLOPs are compared, so a busy machine changes nothing but the
run time (a few minutes on 2 cores).
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import io
import os
from dataclasses import replace
import sys
import tempfile
from functools import partial

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _autosac  # noqa: E402
from _autosac import WORLD  # noqa: E402
from examples.llama import LLAMA_TEST, LlamaConfig, tiny_llama  # noqa: E402

FRACTIONS = (0.1, 0.5, 0.9)
GiB = 2**30


def build(config: LlamaConfig, wrapping):
    """A fresh model (the same weights every time) wrapped as `wrapping` says."""
    from remat.fx_passes.eager.apply import apply_eager

    torch.manual_seed(0)
    model, _ = tiny_llama(config)
    kind, payload = wrapping
    if kind == "remat":
        apply_eager(model, payload)
    elif kind == "autosac":
        _autosac.wrap_counting(model, payload)
    elif kind == "every block":
        for layer in model.layers:
            layer.forward = partial(checkpoint, layer.forward, use_reentrant=False)
    return model


def inputs_of(config: LlamaConfig, batch: int, rank: int) -> tuple:
    g = torch.Generator().manual_seed(rank)
    return (torch.randint(0, config.vocab_size, (batch, config.seq), generator=g),
            torch.randint(0, config.vocab_size, (batch, config.seq), generator=g))


def flops(config, batch, wrapping) -> float | str:
    """The FLOPs of one forward and backward on one process, or the error it raised."""
    from torch.utils.flop_counter import FlopCounterMode

    from remat.fx_passes.measuring.flops import register_cpu_attention

    register_cpu_attention()
    try:
        model = build(config, wrapping)
        counter = FlopCounterMode(display=False)
        with counter:
            torch.manual_seed(11)
            model(*inputs_of(config, batch, 0)).backward()
        return counter.get_total_flops()
    except Exception as e:  # noqa: BLE001 - the table reports what breaks
        return _error(e)


def _error(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0][:80]}"


def _step_on_rank(config, batch, wrapping, rank, mesh):
    """(rank peak, FSDPMemTracker peak, gradient shards) of one configuration on this rank."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed.fsdp import fully_shard

    from tests.allocator import allocator_peak, storage_bytes

    model = build(config, wrapping)
    layers = list(model.layers)
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for a, b in zip(layers, layers[1:]):
        a.set_modules_to_forward_prefetch([b])
        b.set_modules_to_backward_prefetch([a])
    inputs = inputs_of(config, batch, rank)

    def step():
        torch.manual_seed(11 + rank)
        model(*inputs).backward()

    step()  # FSDP2's lazy initialization, outside the measurement
    gc.collect()  # the previous configuration's model, freed now rather than mid-step
    held = storage_bytes([p.to_local() for p in model.parameters()] + list(inputs))
    peaks = []
    for _ in range(5):
        model.zero_grad(set_to_none=True)
        peaks.append(allocator_peak(step)[0])
    grads = {n: p.grad.to_local().clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    try:
        tracker = FSDPMemTracker(model)
        tracker.track_inputs(inputs)
        with tracker:
            step()
        tracked = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    except Exception as e:  # noqa: BLE001
        tracked = _error(e)
    return held + min(peaks), tracked, grads


def _rank(rank, init, jobs, results):
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (WORLD,))
    out = {}
    for (variant, name), (config, batch, wrapping) in jobs.items():
        try:
            out[variant, name] = _step_on_rank(config, batch, wrapping, rank, mesh)
        except Exception as e:  # noqa: BLE001 - the table reports what breaks
            out[variant, name] = _error(e)
        dist.barrier()
    torch.save(out, f"{results}.{rank}")
    dist.destroy_process_group()


def plan_configurations(config, batch, fractions, time_limit, objective):
    """{name: (wrapping, budget in bytes or None, planned peak or note)} for one model."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    import remat
    from remat.solvers import SolverOptions

    with FakeTensorMode(), contextlib.redirect_stdout(io.StringIO()):  # its estimator prints
        fake_model, fake_inputs = tiny_llama(config, batch=batch)
        auto = _autosac.module_graph(fake_model, fake_inputs)
    low, high = _autosac.budget_range(auto)
    budgets = [low + f * (high - low) for f in fractions]
    rows = {"no checkpointing": (("none", None), None, ""),
            "checkpoint every block": (("every block", None), None, "")}
    notes = [f"sac_milp solves from {low * GiB:,.0f} B; its step without checkpointing: "
             f"{high * GiB:,.0f} B per rank"]
    for b in budgets:
        d = _autosac.decisions(auto, b)
        ratios = ", ".join(f"{k.split('.')[-1]}:{r:.2f}" for k, r in sorted(d.ratios.items()))
        planned = f"{d.peak_bound:,}" if d.peak_bound >= 0 else "no solution"
        rows[f"AutoSAC {b * GiB / 1e6:.3f} MB"] = (("autosac", d.ops), b, planned)
        notes.append(f"AutoSAC at {b:.6f} GiB discards per block {{{ratios}}}"
                     + "".join(f"; {n}" for n in d.notes))
    model, inputs = tiny_llama(config, batch=batch)
    training = remat.Training(data_parallel=WORLD, zero_stage=3, optimizer="sgd", reserve=0,
                              fragmentation=0)
    options = SolverOptions(time_limit=time_limit, objective=objective)
    for b in budgets:
        name = f"remat {b * GiB / 1e6:.3f} MB"
        try:
            plan = remat.optimize(model, budget=int(b * GiB), example_inputs=inputs,
                                  training=training, solver_options=options, execution="eager")
            rows[name] = (("remat", plan.block_policies), b, f"{plan.peak:,}")
        except remat.RematError as e:
            rows[name] = (None, b, _error(e))
    return rows, notes


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dropout", type=float, default=0.1,
                        help="the first variant's dropout (the second has none)")
    parser.add_argument("--batch", type=int, default=8, help="per rank")
    parser.add_argument("--fractions", type=float, nargs="+", default=FRACTIONS,
                        help="budgets, as fractions of the way from sac_milp's least to none")
    parser.add_argument("--time-limit", type=float, default=10, help="remat's solver, seconds")
    parser.add_argument("--objective", default="flops", choices=["flops", "time"],
                        help="what remat minimizes (AutoSAC minimizes roofline time)")
    args = parser.parse_args(argv)

    variants, jobs, config_of = {}, {}, {}
    for dropout in dict.fromkeys((args.dropout, 0.0)):
        config = replace(LLAMA_TEST, hidden=64, mlp=176, seq=64, layers=args.layers,
                         dropout=dropout)
        config_of[dropout] = config
        rows, notes = plan_configurations(config, args.batch, args.fractions, args.time_limit,
                                          args.objective)
        counted = {name: flops(config, args.batch, w) for name, (w, _, _) in rows.items()
                   if w is not None}
        variants[dropout] = (rows, notes, counted)
        jobs.update({(dropout, name): (config, args.batch, w) for name, (w, _, _) in rows.items()
                     if w is not None})
    with tempfile.TemporaryDirectory() as tmp:
        results = os.path.join(tmp, "r")
        mp.spawn(_rank, args=(f"file://{tmp}/rv", jobs, results), nprocs=WORLD, join=True)
        ranks = [torch.load(f"{results}.{r}", weights_only=False) for r in range(WORLD)]
    for dropout, (rows, notes, counted) in variants.items():
        print(f"\ntiny Llama: {args.layers} layers, hidden 64, seq 64, batch {args.batch} per "
              f"rank, dropout {dropout}; FSDP2 on {WORLD} gloo ranks (CPU); remat minimizes "
              f"recompute {args.objective}, AutoSAC roofline time (H100 figures)")
        print_table(dropout, rows, counted, ranks)
        for note in notes + _unplanned(dropout, rows, ranks, config_of[dropout]):
            print(f"- {note}")


def print_table(variant, rows, counted, ranks) -> None:
    header = ("configuration", "budget B/rank", "planned peak", "rank 0 peak", "rank 1 peak",
              "vs budget", "FSDPMemTracker r0 / r1", "recompute GFLOP", "gradients")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    base = counted["no checkpointing"]
    reference = [r[variant, "no checkpointing"] for r in ranks]
    for name, (wrapping, budget, planned) in rows.items():
        cells = [name, f"{budget * GiB:,.0f}" if budget else "-", planned or "-"]
        measured = [r.get((variant, name), "not run") for r in ranks]
        failed = next((m for m in measured if isinstance(m, str)), None)
        if wrapping is None:
            cells += ["-"] * 6
        elif failed is not None:
            cells += [f"fails: {failed}", "-", "-", "-"]
        else:
            peaks = [m[0] for m in measured]
            over = f"{max(peaks) / (budget * GiB) - 1:+.1%}" if budget else "-"
            tracked = " / ".join(f"{m[1]:,}" if isinstance(m[1], int) else m[1]
                                 for m in measured)
            cells += [f"{peaks[0]:,}", f"{peaks[1]:,}", over, tracked]
        f = counted.get(name)
        if wrapping is not None:
            cells.append(f if isinstance(f, str) else f"{(f - base) / 1e9:.4f}")
            cells.append("-" if failed is not None else "reference" if name == "no checkpointing"
                         else "equal" if _same(measured, reference) else "DIFFER")
        print("| " + " | ".join(cells) + " |")


def _unplanned(variant, rows, ranks, config) -> list[str]:
    """What each remat row measured above its planned peak, beside the bytes of one block's
    unsharded parameters (what FSDP2 gathers, and remat's eager mode may not yet count)."""
    block = sum(p.numel() * p.element_size() for p in tiny_llama(config)[0].layers[0].parameters())
    out = []
    for name, (wrapping, _, planned) in rows.items():
        measured = [r.get((variant, name)) for r in ranks]
        if name.startswith("remat") and all(isinstance(m, tuple) for m in measured):
            above = max(m[0] for m in measured) - int(planned.replace(",", ""))
            out.append(f"{name}: measured {above:,} B above its planned peak "
                       f"(one block's unsharded parameters: {block:,} B)")
    return out


def _same(measured, reference) -> bool:
    """Each rank's gradient shards equal (rel 1e-5) those of its step without checkpointing."""
    return all(isinstance(ref, tuple) and all(
        torch.allclose(m[2][n], ref[2][n], rtol=1e-5, atol=1e-7) for n in ref[2])
        for m, ref in zip(measured, reference))


if __name__ == "__main__":
    main()
