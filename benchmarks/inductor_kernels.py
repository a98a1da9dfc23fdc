"""How many kernels Inductor generates for one training step, what the step holds and how long
it takes, by how the joint graph was partitioned: a lead on why remat's compiled step
(compile=True) with nothing recomputed ran slower than torch.compile's on a GPU
(docs/inductor.md, "On a GPU").

Runners, each one training step of a small transformers Qwen2 (fp32):
- `torch.compile`: the default (min-cut partitioner at activation_memory_budget 1.0, which
  still recomputes pointwise ops in the backward where Inductor fuses them into their
  readers; Inductor's joint-graph passes);
- `aot + min-cut`: AOTAutograd with the min-cut partitioner and Inductor's decompositions,
  compiled by `compile_fx_inner` as remat compiles (no joint-graph passes);
- `aot + save all`: the same with the default partitioner (every forward value saved);
- `remat save-all`: remat's save-all schedule through `planned_module(..., compile=True)`;
- `remat pointwise recomputed`: that schedule with every recomputable pointwise value
  (``torch.Tag.pointwise``) recomputed just before its reader instead;
- `remat pointwise, pointwise readers`: only those whose backward readers (of their storage,
  views included) are all pointwise (the recomputations Inductor can fuse into their readers).

Printed, per runner: Inductor's generated kernel count over three warm-up steps (the compiles;
`torch._inductor.metrics`), the allocator's peak of the third step (the gradients included;
`remat.fx_passes.measuring.allocator.step_peak`: torch.profiler's memory events on the CPU,
``max_memory_allocated`` after ``reset_peak_memory_stats`` on CUDA), for remat's rows the
simulated peak, then `step ms`: the median of `--steps` more steps, forward and backward, timed
alone (the wall clock, between ``torch.cuda.synchronize()`` calls on CUDA), and
`step / torch.compile`: that median over torch.compile's (on a CPU other processes share, the
times are noise: Inductor's OpenMP kernels wait for descheduled threads).

    python benchmarks/inductor_kernels.py [--device cpu|cuda] [--layers 2] [--hidden 64]
        [--seq 32] [--batch 2] [--vocab 256] [--intermediate 128] [--steps 5]

On a GPU, at benchmarks/inductor.py's Qwen2 (`INDUCTOR_QWEN2`):

    python benchmarks/inductor_kernels.py --device cuda --layers 4 --hidden 256 --seq 256 \\
        --batch 4 --vocab 1024 --intermediate 1024

or ``python benchmarks/gpu_check.py --checks kernels`` (`kernels_table`).
"""
from __future__ import annotations

import argparse
import copy
import gc
import os
import statistics
import sys
import time

os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")  # no oversubscription on a CPU

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/inductor.py

from tabulate import tabulate  # noqa: E402

from remat.fx_passes.measuring.allocator import step_peak  # noqa: E402

# benchmarks/inductor.py's Qwen2 (its `qwen2()`), in `qwen2`'s parameters.
INDUCTOR_QWEN2 = dict(layers=4, hidden=256, seq=256, batch=4, vocab=1024, intermediate=1024)
HEADERS = ["runner", "recomputed", "kernels", "allocator B", "simulated B", "step ms",
           "step / torch.compile"]


def qwen2(layers: int = 2, hidden: int = 64, seq: int = 32, batch: int = 2, vocab: int = 256,
          intermediate: int | None = None, device: str = "cpu"):
    """(a Qwen2ForCausalLM in training mode, its inputs), on `device`. `intermediate` defaults
    to twice `hidden`; positions to max(64, 2 * seq) (512 at inductor.py's seq 256)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=intermediate or 2 * hidden,
                         vocab_size=vocab, max_position_embeddings=max(64, 2 * seq),
                         use_cache=False)
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(1))
    ids = ids.to(device)
    return Qwen2ForCausalLM(config).train().to(device), {"input_ids": ids, "labels": ids}


def read(call, model, kwargs: dict, loss_of, steps: int = 0) -> tuple[int, int, float]:
    """(kernels generated, the allocator's peak of the third step, the median seconds of
    `steps` more steps, timed without the allocator's measurement; nan when `steps` is 0)."""
    from torch._inductor import metrics

    device = next(model.parameters()).device
    metrics.reset()
    for _ in range(3):
        model.zero_grad(set_to_none=True)
        peak, held = step_peak(lambda: call(**kwargs),
                               lambda out, seed: loss_of(out).backward(seed), device.type)
        del held
    kernels = metrics.generated_kernel_count
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    gc.collect()  # the compiles' garbage, collected outside the timed steps
    times = []
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        sync()
        began = time.perf_counter()
        loss_of(call(**kwargs)).backward()
        sync()
        times.append(time.perf_counter() - began)
    model.zero_grad(set_to_none=True)
    return kernels, peak, statistics.median(times) if times else float("nan")


def aot_backend(save_all: bool):
    from functorch.compile import min_cut_rematerialization_partition
    from torch._functorch.partitioners import default_partition

    from inductor import inductor_backend

    return inductor_backend(default_partition if save_all
                            else min_cut_rematerialization_partition)


def pointwise_recomputed(problem, captured, fused_readers: bool = False) -> set[int]:
    """Every recomputable pointwise value; with `fused_readers`, only those whose backward
    readers (of their storage, views included) are all pointwise: the recomputations Inductor
    can fuse into their readers."""
    from remat.solvers.core.schedule import drop_unneeded, recomputable

    nodes = {n.name: n for n in captured.graph.nodes if n.op == "call_function"}
    nf = problem.num_forward

    def pointwise(v: int) -> bool:
        node = nodes.get(problem.ops[v].name)
        return node is not None and torch.Tag.pointwise in getattr(node.target, "tags", ())

    def read_fused(v: int) -> bool:
        readers = [r for r in problem.storage_readers[v] if r >= nf]
        return bool(readers) and all(pointwise(r) for r in readers)

    return drop_unneeded(problem, [v for v in recomputable(problem) if pointwise(v)
                                   and (not fused_readers or read_fused(v))])


def kernels_rows(device: str = "cpu", steps: int = 5, **sizes) -> list[list]:
    """The six runners' rows (`HEADERS`) on `device`; `sizes`: `qwen2`'s parameters."""
    if device == "cuda" and os.environ.get("TORCHINDUCTOR_COMPILE_THREADS") == "1":
        from torch._inductor import config  # the one thread set above is the CPU's: not here

        config.compile_threads = min(32, len(os.sched_getaffinity(0)))
    base, kwargs = qwen2(device=device, **sizes)
    rows = []

    def add(label, recomputed, reading, simulated):
        kernels, peak, seconds = reading
        rows.append([label, recomputed, kernels, peak, simulated, seconds * 1e3])
        print(rows[-1], flush=True)

    for label, backend in (("torch.compile", "inductor"), ("aot + min-cut", aot_backend(False)),
                           ("aot + save all", aot_backend(True))):
        torch._dynamo.reset()
        model = copy.deepcopy(base)
        add(label, "", read(torch.compile(model, backend=backend), model, kwargs,
                            lambda out: out.loss, steps), "")
        del model

    from remat.fx_passes.compiled.planned import planned_module
    from remat.fx_passes.lowering.lower import lower
    from remat.fx_passes.tracing.capture import capture
    from remat.solvers.timeline.evaluate import make_schedule

    captured = capture(copy.deepcopy(base), example_kwargs=kwargs)
    problem = lower(captured)
    for label, recomputed in (("remat save-all", set()),
                              ("remat pointwise recomputed",
                               pointwise_recomputed(problem, captured)),
                              ("remat pointwise, pointwise readers",
                               pointwise_recomputed(problem, captured, fused_readers=True))):
        schedule = make_schedule(problem, recomputed)
        torch._dynamo.reset()
        model = copy.deepcopy(base)
        module = planned_module(model, problem, schedule, compile=True)
        add(label, len(schedule.recomputed), read(module, model, kwargs, lambda out: out, steps),
            schedule.peak)
        del module, model
    torch._dynamo.reset()
    reference = rows[0][5]
    for row in rows:
        row.append(row[5] / reference)
    return rows


def kernels_table(device: str = "cpu", steps: int = 5, **sizes) -> str:
    """`kernels_rows` as a table: e.g. ``kernels_table("cuda", **INDUCTOR_QWEN2)``."""
    rows = [[*row[:6], f"{row[6]:.2f}x"] for row in kernels_rows(device, steps, **sizes)]
    return tabulate(rows, headers=HEADERS, intfmt=",", floatfmt=".2f")


def kernels_part(device: str, steps: int) -> bool:
    """gpu_check's `kernels` part: the table at inductor.py's Qwen2 on CUDA, at the tiny
    default sizes on the CPU (a dry run); a measurement, so True unless it raised."""
    print(kernels_table(device, steps, **(INDUCTOR_QWEN2 if device == "cuda" else {})),
          flush=True)
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--intermediate", type=int, default=None,
                        help="the MLP's width (default: twice --hidden)")
    parser.add_argument("--steps", type=int, default=5,
                        help="steps timed after the three warm-up steps (their median)")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here")
    print(kernels_table(args.device, args.steps, layers=args.layers, hidden=args.hidden,
                        seq=args.seq, batch=args.batch, vocab=args.vocab,
                        intermediate=args.intermediate))


if __name__ == "__main__":
    main()
