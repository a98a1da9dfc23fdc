"""GPU check: plan a model on CUDA at three budgets, run a few steps of each plan, and check
that the allocator's peak (torch.cuda.max_memory_allocated) is at most the simulated peak and
within 2 % of it (remat's accuracy promise, docs/memory-and-accuracy.md), on the device where
cuDNN and cuBLAS choose their workspaces.

    python benchmarks/gpu_check.py [--model gpt2-medium|unet] [--batch 16] [--seq 1024]
                                   [--steps 3] [--time-limit 60]

The model is captured with its weights on the GPU, so every op's kernel scratch is measured
there (max_memory_allocated around the op, `remat.fx_passes.measuring.scratch`). GPT-2 medium (bf16)
defaults to an activation peak of roughly half of an 80 GB card without checkpointing; the
U-Net (fp32, cuDNN convolutions) is the case with the largest workspaces. Prints, per budget:
the simulated activation peak, the allocator's peak of a step above its baseline (parameters,
optimizer state, batch; the backward's seed left out, `remat.fx_passes.measuring.allocator.step_peak`),
the check, max_memory_reserved above its baseline, the step time (CUDA events), and MFU / HFU
against the card's dense bf16 peak. Exits 0 with a message where there is no CUDA, 1 when a
check is missed. Meant to finish within five minutes on an H100/H200.

Three more checks, each a short table:
- **the plan's step against eager**: the plain eager step of the same model (no remat), its
  allocator peak and step time, beside the save-all plan's (a plan that recomputes nothing
  must not cost more than eager);
- **op times against the roofline**: every op of the graph timed alone (CUDA events, median of
  3) against `remat.fx_passes.measuring.timing.roofline` for the target: the total, the median ratio,
  and the ops with the largest measured times;
- **offload**: the save-all schedule with its largest saved tensors kept
  in host memory where the transfer timeline hides them, run with its copies on copy streams:
  the allocator's peak against the simulated device peak (the same contract, within
  [-2 %, 0 %]), and the measured extra step time against the predicted exposed time
  (`remat.solvers.timeline.overlap`, with the link's bandwidth measured here): see
  benchmarks/_offload_check.py. ``--checks offload`` runs this check alone (a few minutes of
  device time); ``--smoke`` runs it on the CPU, on a tiny model, to exercise its code.
- **Inductor**: `benchmarks/inductor.py`'s comparison on CUDA, on its U-Net: torch.compile at
  activation_memory_budget 0.4 and 0.8 beside `remat.optimize(..., compile=True)` at each of
  their measured peaks and at remat's least; the check is the allocator at most the plan's
  peak at most the budget in every remat row (a torch.compile point lower on both memory and
  recompute FLOPs is printed, not counted). ``--checks inductor`` runs it alone.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from remat.errors import BudgetError  # noqa: E402

GiB = 2**30
# Dense bf16 tensor-core peaks by device-name fragment (vendor datasheets, as in devices.py).
PEAK_BF16 = {"H200": 989.4e12, "H100": 989.4e12, "A100": 312e12, "L4": 121e12, "4090": 165.2e12}


def peak_flops(name: str) -> float | None:
    return next((v for k, v in PEAK_BF16.items() if k in name), None)


def gpt2_medium(batch: int, seq: int, device: str):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_embd=1024, n_layer=24, n_head=16, n_positions=max(1024, seq),
                        vocab_size=50257, attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device(device):
        model = GPT2LMHeadModel(config).to(torch.bfloat16).train()
    model.loss_type = "ForCausalLM"

    class LMLoss(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.model = inner
            self.loss_type = "ForCausalLM"

        def forward(self, ids):
            return self.model(input_ids=ids, labels=ids).loss

    ids = torch.randint(0, config.vocab_size, (batch, seq), device=device)
    return LMLoss(model), (ids,)


def unet(batch: int, size: int, device: str):
    from tests.models import UNet

    torch.manual_seed(0)
    with torch.device(device):
        model = UNet(channels=(32, 64, 128, 256)).train()
        x = torch.randn(batch, 1, size, size)
        y = torch.randn(batch, 1, size, size)
    return model, (x, y)


def run_plan(model, inputs, problem, schedule, steps: int):
    from remat.fx_passes.measuring.allocator import step_peak
    from remat.fx_passes.compiled.planned import planned_module

    module = planned_module(model, problem, schedule)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    times, allocated, reserved = [], 0, 0
    for step in range(steps + 1):  # the first step compiles and creates the optimizer state
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base_reserved = torch.cuda.memory_reserved()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        peak, loss = step_peak(lambda: module(*inputs), lambda out, seed: out.backward(seed),
                               "cuda")
        end.record()
        torch.cuda.synchronize()
        if step:
            times.append(start.elapsed_time(end) / 1e3)
            allocated = max(allocated, peak)
            reserved = max(reserved, torch.cuda.max_memory_reserved() - base_reserved)
        opt.step()
        del loss
    del module, opt
    return sorted(times)[len(times) // 2], allocated, reserved


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("gpt2-medium", "unet"), default="gpt2-medium")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--time-limit", type=float, default=60.0)
    parser.add_argument("--checks", choices=("all", "offload", "inductor"), default="all",
                        help="offload: only the overlapped offload against its prediction; "
                             "inductor: only remat compiled against torch.compile's budget")
    parser.add_argument("--smoke", action="store_true",
                        help="run the offload check on the CPU on a tiny model (code paths)")
    args = parser.parse_args(argv)
    if args.smoke:
        from _offload_check import smoke

        return smoke()
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; nothing to check (run it on a GPU machine)")
        return 0

    from tabulate import tabulate

    if args.checks == "inductor":
        return 0 if inductor_part() else 1

    from remat.fx_passes.tracing.capture import capture
    from remat.fx_passes.lowering.lower import lower
    from remat.solvers import SolverOptions, solve
    from remat.solvers.core.schedule import drop_unneeded, recomputable
    from remat.solvers.timeline.evaluate import make_schedule
    from remat.solvers.timeline.simulate import simulate

    begin = time.perf_counter()
    name = torch.cuda.get_device_name()
    if args.model == "unet":
        model, inputs = unet(args.batch, args.seq, "cuda")
        what = f"U-Net fp32, batch {args.batch} x {args.seq}^2"
    else:
        model, inputs = gpt2_medium(args.batch, args.seq, "cuda")
        what = f"GPT-2 medium bf16, batch {args.batch} x {args.seq}"
    target = "h200" if "H200" in name else "h100" if "H100" in name else "a100-80gb"
    captured = capture(model, inputs)
    problem = lower(captured, target=target)  # kernel scratch measured on this GPU
    scratch = max(n.meta["remat"].get("scratch", 0) for n in captured.graph.nodes
                  if "remat" in n.meta)
    print(f"# {name}: {what}, {len(problem)} ops, largest kernel scratch "
          f"{scratch / 2**20:.1f} MiB, planned in {time.perf_counter() - begin:.0f} s",
          flush=True)
    if args.checks == "offload":
        ok = offload_part(model, inputs, problem, target, args.steps)
        print(f"# total {time.perf_counter() - begin:.0f} s; offload check "
              f"{'passed' if ok else 'MISSED'}")
        return 0 if ok else 1

    save_all = make_schedule(problem, ())
    full = simulate(problem, save_all).peak
    everything = make_schedule(problem, drop_unneeded(problem, recomputable(problem)))
    options = SolverOptions(time_limit=args.time_limit, hint=everything)
    plans = [("save all", save_all)]
    for fraction in (0.6, 0.35):
        try:
            plans.append((f"{fraction:.0%}", solve(problem, int(full * fraction), "optimal",
                                                   options)))
        except BudgetError as e:
            print(f"# {fraction:.0%} of the save-all peak does not fit: {e}", flush=True)

    peak = peak_flops(name)
    rows, missed = [], 0
    for label, schedule in plans:
        predicted = simulate(problem, schedule).peak
        seconds, allocated, reserved = run_plan(model, inputs, problem, schedule, args.steps)
        model_flops = problem.total_flops
        hardware_flops = model_flops + schedule.recompute_flops
        ok = 0.98 * predicted <= allocated <= predicted
        missed += not ok
        rows.append([label, len(schedule.recomputed), f"{predicted / GiB:.3f}",
                     f"{allocated / GiB:.3f}", f"{(allocated - predicted) / predicted:+.2%}",
                     "ok" if ok else "MISSED", f"{reserved / GiB:.2f}", f"{seconds * 1e3:.0f}",
                     f"{model_flops / seconds / peak:.1%}" if peak else "-",
                     f"{hardware_flops / seconds / peak:.1%}" if peak else "-"])
        print(f"# {label} done at {time.perf_counter() - begin:.0f} s", flush=True)
        torch._dynamo.reset()
    print(tabulate(rows, headers=["budget", "recomputed", "simulated GiB", "allocator GiB",
                                  "error", "check", "max reserved GiB", "step ms", "MFU", "HFU"],
                   disable_numparse=True))
    checked = len(rows)

    eager_seconds, eager_peak = run_eager(model, inputs, args.steps)
    plan_seconds = float(rows[0][7]) / 1e3
    slower = plan_seconds > 1.05 * eager_seconds
    missed += slower
    print(tabulate([["eager (no remat)", f"{eager_peak / GiB:.3f}", f"{eager_seconds * 1e3:.0f}"],
                    ["save-all plan", rows[0][3], rows[0][7]]],
                   headers=["step", "allocator GiB", "step ms"], disable_numparse=True))
    print(f"# the save-all plan's step is {plan_seconds / eager_seconds:.2f}x eager's "
          f"({'MISSED: over 1.05x' if slower else 'ok'})", flush=True)

    op_rows, measured_total, roofline_total, ratios = time_ops(captured, target)
    print(tabulate(op_rows, headers=["op", "target", "measured us", "roofline us", "ratio"],
                   disable_numparse=True))
    ratios.sort()
    print(f"# ops: measured {measured_total * 1e3:.1f} ms in all against a roofline of "
          f"{roofline_total * 1e3:.1f} ms ({measured_total / roofline_total:.2f}x); median "
          f"ratio {ratios[len(ratios) // 2]:.2f} over {len(ratios)} timed ops", flush=True)

    missed += not offload_part(model, inputs, problem, target, args.steps)
    missed += not inductor_part()
    checked += 2
    print(f"# total {time.perf_counter() - begin:.0f} s; {checked - missed}/{checked} checks "
          "passed")
    return 1 if missed else 0


def inductor_part() -> bool:
    """benchmarks/inductor.py's U-Net on CUDA: torch.compile at 0.4 and 0.8 beside remat
    compiled with Inductor; True when every remat row's allocator <= plan <= budget."""
    import inductor

    torch._dynamo.reset()
    rows = inductor.rows_of(inductor.on(inductor.unet(), "cuda"), [0.4, 0.8])
    inductor.verdicts(rows)
    print(inductor.table(rows), flush=True)
    return all(r.verdict.startswith("ok") for r in rows
               if r.runner.startswith("remat") and r.activations >= 0)


def offload_part(model, inputs, problem, target: str, steps: int) -> bool:
    """The overlapped offload against its prediction (benchmarks/_offload_check.py)."""
    from tabulate import tabulate

    from _offload_check import HEADERS, check_overlapped_offload
    from remat.fx_passes.measuring.devices import device

    row, ok, notes = check_overlapped_offload(model, inputs, problem, steps,
                                              torch.device("cuda"), device(target).host_link)
    print(tabulate([row], headers=HEADERS, disable_numparse=True))
    print("\n".join(f"# {n}" for n in notes), flush=True)
    return ok


def run_eager(model, inputs, steps: int) -> tuple[float, int]:
    """Median step seconds and the allocator's peak of the plain eager step."""
    from remat.fx_passes.measuring.allocator import step_peak

    times, peak = [], 0
    for step in range(steps + 1):
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step_peak_bytes, loss = step_peak(lambda: model(*inputs),
                                          lambda out, seed: out.backward(seed), "cuda")
        end.record()
        torch.cuda.synchronize()
        if step:
            times.append(start.elapsed_time(end) / 1e3)
            peak = max(peak, step_peak_bytes)
        del loss
    model.zero_grad(set_to_none=True)
    return sorted(times)[len(times) // 2], peak


def time_ops(captured, target: str, top: int = 8, on: str = "cuda"):
    """Every call of the captured graph timed alone against its roofline."""
    from remat.fx_passes.measuring.devices import device
    from remat.fx_passes.measuring.timing import measure_node, roofline

    chip, cuda = device(target), torch.device(on)
    timed = []
    for node in captured.graph.nodes:
        if node.op != "call_function":
            continue
        flops = node.meta.get("remat", {}).get("flops", 0)
        predicted = roofline(node, flops, chip)
        seconds = measure_node(node, cuda, runs=3, warmup=1)
        if seconds is not None and predicted > 0:
            timed.append((seconds, predicted, node))
    timed.sort(key=lambda t: -t[0])
    rows = [[n.name, str(n.target), f"{m * 1e6:.1f}", f"{r * 1e6:.1f}", f"{m / r:.2f}"]
            for m, r, n in timed[:top]]
    return (rows, sum(m for m, _, _ in timed), sum(r for _, r, _ in timed),
            [m / r for m, r, _ in timed])


if __name__ == "__main__":
    sys.exit(main())
