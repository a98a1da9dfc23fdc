"""How many kernels Inductor generates for one training step, and what the step holds, by how
the joint graph was partitioned: a lead on why remat's compiled step (compile=True) with
nothing recomputed ran slower than torch.compile's on a GPU (docs/inductor.md, "On a GPU").

Runners, each one training step of a small transformers Qwen2 (the third, after compiles):
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

Printed: Inductor's generated kernel count (`torch._inductor.metrics`), the allocator's step
peak (torch.profiler's memory events on the CPU, the gradients included) and, for remat's
rows, the simulated peak.

    python benchmarks/inductor_kernels.py [--layers 2] [--hidden 64] [--seq 32]
"""
from __future__ import annotations

import argparse
import copy
import os
import sys

os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")  # no oversubscription on a CPU

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/inductor.py

from tabulate import tabulate  # noqa: E402

from remat.fx_passes.measuring.allocator import step_peak  # noqa: E402


def qwen2(layers: int, hidden: int, seq: int):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=2 * hidden, vocab_size=256,
                         max_position_embeddings=max(64, seq), use_cache=False)
    ids = torch.randint(0, 256, (2, seq), generator=torch.Generator().manual_seed(1))
    return Qwen2ForCausalLM(config).train(), {"input_ids": ids, "labels": ids}


def read(call, model, kwargs: dict, loss_of) -> tuple[int, int]:
    """(kernels generated, the allocator's peak of the third step)."""
    from torch._inductor import metrics

    metrics.reset()
    for _ in range(3):
        model.zero_grad(set_to_none=True)
        peak, held = step_peak(lambda: call(**kwargs),
                               lambda out, seed: loss_of(out).backward(seed), "cpu")
        del held
    return metrics.generated_kernel_count, peak


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--seq", type=int, default=32)
    args = parser.parse_args()
    base, kwargs = qwen2(args.layers, args.hidden, args.seq)
    rows = []
    for label, backend in (("torch.compile", "inductor"), ("aot + min-cut", aot_backend(False)),
                           ("aot + save all", aot_backend(True))):
        torch._dynamo.reset()
        model = copy.deepcopy(base)
        kernels, peak = read(torch.compile(model, backend=backend), model, kwargs,
                             lambda out: out.loss)
        rows.append([label, "", kernels, peak, ""])
        print(rows[-1], flush=True)

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
        kernels, peak = read(module, model, kwargs, lambda out: out)
        rows.append([label, len(schedule.recomputed), kernels, peak, schedule.peak])
        print(rows[-1], flush=True)
    print(tabulate(rows, headers=["runner", "recomputed", "kernels", "allocator B",
                                  "simulated B"], intfmt=","))


if __name__ == "__main__":
    main()
