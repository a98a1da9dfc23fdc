"""remat compiled with Inductor against torch.compile's own activation budget, by the allocator.

For each model: plain eager; `torch.compile` with `torch._functorch.config.
activation_memory_budget` at each `--budgets` fraction (Inductor, its min-cut partitioner);
per-block checkpointing (remat's `checkpoint_blocks` schedule, compiled by Inductor); and
`remat.optimize(..., compile=True)` at each peak torch.compile measured and at remat's own
least under Inductor. Every row is one training step (the third, after compiles and warm-up)
of the same weights and batch:
- `activations`: the allocator's peak (torch.profiler's memory events on the CPU,
  ``max_memory_allocated`` on CUDA) less the gradients the step leaves;
- `remat plan`: the plan's activation peak (remat's reading under Inductor) and `simulated`
  its op-by-op simulation;
- `recompute`: FLOPs run again (torch.compile: the partitioned graphs' FLOPs less the joint
  graph's; remat: the plan's);
- `step`: the fastest of `ROUNDS` steps over the fastest of as many of plain eager's, each
  step beside one of eager's.
`verdict` (remat rows): allocator <= the plan's peak <= budget, and the rows of torch.compile
or per-block lower than it on both memory and recompute FLOPs (a peer that dominates).

    python benchmarks/inductor.py [--models vit unet qwen2 llama] [--budgets 0.2 0.4 0.6 0.8 1.0]
        [--only least] [-v]

`--only least` runs eager and remat's least alone (every other row is a compile or more; a
least row is compared with the others of an earlier run by hand); `-v` logs remat's solves
and Inductor readings as they come.
"""
from __future__ import annotations

import argparse
import copy
import logging
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable

os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")  # no oversubscription on a CPU

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tabulate import tabulate  # noqa: E402

import remat  # noqa: E402
from remat.fx_passes.compiled.measure_step import time_step  # noqa: E402
from remat.fx_passes.measuring.allocator import step_peak  # noqa: E402
from remat.fx_passes.measuring.storage import held_bytes  # noqa: E402
from remat.fx_passes.measuring.flops import node_flops  # noqa: E402
from remat.solvers import SolverOptions  # noqa: E402

MIB = 2**20
# Each remat solve's limit in seconds (gpu_check.py lowers it to fit its device time).
TIME_LIMIT = 60.0
# Steps timed per row, each beside one of plain eager's (`measure`). Timed apart, fastest of
# five, one U-Net plan read 1.02x of eager at one budget and 0.81x at the next a minute later.
ROUNDS = 9


@dataclass
class Case:
    name: str
    model: torch.nn.Module
    args: tuple
    kwargs: dict


@dataclass
class Row:
    model: str
    runner: str
    activations: int
    recompute: int
    step: float
    plan: int | None = None
    simulated: int | None = None
    budget: int | None = None
    verdict: str = ""


def loss_of(out: Any) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else out.loss


def on(case: Case, device: str) -> Case:
    """`case` with its model and inputs on `device`."""
    def move(x):
        return x.to(device) if isinstance(x, torch.Tensor) else x
    return Case(case.name, case.model.to(device), tuple(move(a) for a in case.args),
                {k: move(v) for k, v in case.kwargs.items()})


def measure(case: Case, call: Callable, eager: Callable[[], None] | None = None
            ) -> tuple[int, float]:
    """(the allocator's activation peak of the third step, the step's time over plain
    eager's): the fastest of `ROUNDS` steps over the fastest of as many steps of `eager`
    (plain eager's step), the two alternating, so that both see the machine as it is then.
    Without `eager`, the step's own fastest in seconds."""
    model = case.model
    device = next(model.parameters()).device
    for _ in range(3):
        for p in model.parameters():
            p.grad = None
        peak, held = step_peak(lambda: call(*case.args, **case.kwargs),
                               lambda out, seed: loss_of(out).backward(seed), device)
        del held
    # The gradients as the allocator holds them (whole 512-byte blocks on CUDA), as remat's
    # own reading counts them: requested bytes left 5,244 B of the U-Net's in the reading.
    grads = sum(held_bytes(p.grad.untyped_storage()) for p in model.parameters()
                if p.grad is not None)

    def step():
        loss_of(call(*case.args, **case.kwargs)).backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    if eager is None:
        return peak - grads, time_step(step)
    pairs = [(time_step(eager, repeat=1, warmup=0), time_step(step, repeat=1, warmup=0))
             for _ in range(ROUNDS)]
    return peak - grads, min(t for _, t in pairs) / min(t for t, _ in pairs)


def graph_flops(gm: torch.fx.GraphModule) -> int:
    return sum(node_flops(n) for n in gm.graph.nodes if n.op == "call_function")


def inductor_backend(partition_fn: Callable) -> Callable:
    """A torch.compile backend: AOTAutograd partitioning with `partition_fn` over Inductor's
    decompositions, each graph compiled by Inductor's `compile_fx_inner` (as remat's
    compile=True compiles; Inductor's joint-graph passes do not run)."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._inductor.compile_fx import compile_fx_inner
    from torch._inductor.decomposition import select_decomp_table

    def compiler(is_backward: bool):
        return lambda gm, inputs: compile_fx_inner(gm, inputs, is_backward=is_backward)

    return aot_autograd(fw_compiler=compiler(False), bw_compiler=compiler(True),
                        partition_fn=partition_fn, decompositions=select_decomp_table())


def torch_compile_row(case: Case, fraction: float, eager: Callable[[], None]) -> Row:
    """torch.compile under activation_memory_budget=`fraction`, its recompute counted in the
    partitioned graphs."""
    from functorch.compile import min_cut_rematerialization_partition

    counted = {"joint": 0, "split": 0}

    def partition(joint, joint_inputs, **kwargs):
        fw, bw = min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)
        counted["joint"] += graph_flops(joint)
        counted["split"] += graph_flops(fw) + graph_flops(bw)
        return fw, bw

    backend = inductor_backend(partition)
    torch._dynamo.reset()
    with torch._functorch.config.patch(activation_memory_budget=fraction):
        compiled = torch.compile(case.model, backend=backend)
        peak, ratio = measure(case, compiled, eager)
    torch._dynamo.reset()
    return Row(case.name, f"torch.compile {fraction:.1f}", peak,
               counted["split"] - counted["joint"], ratio)


def remat_row(case: Case, runner: str, eager: Callable[[], None], **options: Any) -> Row:
    torch._dynamo.reset()
    plan = remat.optimize(case.model, example_inputs=case.args, example_kwargs=case.kwargs,
                          compile=True, solver_options=SolverOptions(time_limit=TIME_LIMIT),
                          **options)
    peak, ratio = measure(case, plan.module, eager)
    budget = options.get("activation_budget")
    return Row(case.name, runner, peak, plan.recompute_flops, ratio,
               plan=plan.activation_peak, simulated=plan.inductor.predicted, budget=budget)


def remat_least(case: Case, eager: Callable[[], None]) -> Row:
    """remat at its least under Inductor: asked for 1 byte, the BudgetError names the least
    plan's reading; asked for that, a solve may return another least plan whose reading
    differs, so the reading it names is asked for again, three times at most."""
    budget = 1
    for _ in range(4):
        try:
            return remat_row(case, "remat least", eager, activation_budget=budget)
        except remat.BudgetError as e:
            print(f"remat least: refused at {budget / MIB:.2f} MiB: {e}", flush=True)
            if e.smallest is None or e.smallest <= budget:
                break
            budget = e.smallest
    return Row(case.name, "remat least", -1, -1, 0.0, budget=budget,
               verdict=f"refused at {budget / MIB:.2f} MiB: the least plan read above it")


def plain_eager(case: Case) -> tuple[int, Callable[[], None]]:
    """(plain eager's activation peak, its step on a copy of the model): the step each row's
    is timed beside (`measure`)."""
    model = copy.deepcopy(case.model)
    peak, _ = measure(Case(case.name, model, case.args, case.kwargs), model)

    def step() -> None:
        loss_of(model(*case.args, **case.kwargs)).backward()
        if next(model.parameters()).device.type == "cuda":
            torch.cuda.synchronize()
    return peak, step


def rows_of(case: Case, fractions: list[float], only_least: bool = False) -> list[Row]:
    eager_peak, eager = plain_eager(case)
    rows = [Row(case.name, "eager", eager_peak, 0, 1.0)]
    if only_least:
        rows.append(remat_least(case, eager))
        return rows
    for fraction in fractions:
        rows.append(torch_compile_row(case, fraction, eager))
        print(rows[-1], flush=True)
    rows.append(remat_row(case, "per-block", eager, activation_budget=10**15,
                          solver="checkpoint_blocks"))
    print(rows[-1], flush=True)
    for peer in sorted({r.activations for r in rows[1:]}):
        try:
            rows.append(remat_row(case, f"remat @ {peer / MIB:.2f} MiB", eager,
                                  activation_budget=peer))
        except remat.BudgetError as e:
            rows.append(Row(case.name, f"remat @ {peer / MIB:.2f} MiB", -1, -1, 0.0,
                            budget=peer, verdict=f"refused: needs {e.smallest / MIB:.2f} MiB"))
        print(rows[-1], flush=True)
    rows.append(remat_least(case, eager))
    return rows


def verdicts(rows: list[Row]) -> None:
    """Each remat row: "ok" where the allocator read at most the plan's peak and the plan's
    peak is at most the budget; then the peers lower on both memory and recompute FLOPs."""
    peers = [r for r in rows if r.runner.startswith(("torch.compile", "per-block"))]
    for row in rows:
        if not row.runner.startswith("remat") or row.activations < 0:
            continue
        fits = row.activations <= row.plan and (row.budget is None or row.plan <= row.budget)
        better = [p.runner for p in peers if p.activations < row.activations
                  and p.recompute < row.recompute]
        row.verdict = (("ok" if fits else "OVER") +
                       (f"; dominated by {', '.join(better)}" if better else ""))


# ----------------------------------------------------------------------------- models
def vit() -> Case:
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(0)
    config = ViTConfig(hidden_size=192, num_hidden_layers=6, num_attention_heads=3,
                       intermediate_size=768, image_size=224, patch_size=16, num_labels=10,
                       hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = ViTForImageClassification(config).train()
    g = torch.Generator().manual_seed(1)
    return Case("ViT", model, (), {"pixel_values": torch.randn(8, 3, 224, 224, generator=g),
                                   "labels": torch.randint(0, 10, (8,), generator=g)})


def qwen2() -> Case:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=1024, vocab_size=1024,
                         max_position_embeddings=512, use_cache=False)
    model = Qwen2ForCausalLM(config).train()
    ids = torch.randint(0, 1024, (4, 256), generator=torch.Generator().manual_seed(1))
    return Case("Qwen2", model, (), {"input_ids": ids, "labels": ids})


def unet() -> Case:
    from tests.models import UNet

    torch.manual_seed(0)
    model = UNet(channels=(16, 32, 64)).train()
    g = torch.Generator().manual_seed(1)
    return Case("U-Net", model, (torch.randn(4, 1, 64, 64, generator=g),
                                 torch.randn(4, 1, 64, 64, generator=g)), {})


def llama() -> Case:
    """examples/llama.py at the size benchmarks/peers.py plans (hidden 256, 8 layers)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _peers_models import llama as peers_llama

    case = peers_llama(quick=False)
    return Case("Llama", case.model, case.inputs, {})


MODELS = {"vit": vit, "qwen2": qwen2, "unet": unet, "llama": llama}


def table(rows: list[Row]) -> str:
    return tabulate([[r.model, r.runner, f"{r.activations / MIB:.2f}" if r.activations >= 0
                      else "-", "" if r.plan is None else f"{r.plan / MIB:.2f}",
                      "" if r.simulated is None else f"{r.simulated / MIB:.2f}",
                      f"{r.recompute / 1e9:.2f}" if r.recompute >= 0 else "-",
                      f"{r.step:.2f}x" if r.step else "-", r.verdict] for r in rows],
                    headers=["model", "runner", "activations MiB", "remat plan MiB",
                             "simulated MiB", "recompute GFLOP", "step / eager", "verdict"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--budgets", nargs="+", type=float, default=[0.2, 0.4, 0.6, 0.8, 1.0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--only", choices=["least"], help="eager and this row alone")
    parser.add_argument("-v", "--verbose", action="store_true", help="log remat's progress")
    args = parser.parse_args()
    if args.verbose:
        logging.basicConfig(format="%(asctime)s %(name)s: %(message)s")
        logging.getLogger("remat").setLevel(logging.INFO)
    for name in args.models:
        rows = rows_of(on(MODELS[name](), args.device), args.budgets, args.only == "least")
        verdicts(rows)
        print(table(rows), flush=True)


if __name__ == "__main__":
    main()
