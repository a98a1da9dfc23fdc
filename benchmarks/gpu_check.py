"""GPU check: plan a model on CUDA at three budgets, run a few steps of each plan, and check
that the allocator's peak (torch.cuda.max_memory_allocated) is at most the simulated peak and
within 2 % of it (remat's accuracy promise, docs/memory-and-accuracy.md), on the device where
cuDNN and cuBLAS choose their workspaces.

    python benchmarks/gpu_check.py [--model gpt2-medium|unet] [--batch 16] [--seq 1024]
        [--steps 3] [--time-limit 60] [--checks PART ...] [--inductor-budgets 0.4 0.8]
        [--dry-run]

Each part runs on its own: one that raises prints its traceback, counts as missed, and the
next part runs. `--dry-run` runs every part on the CPU at tiny sizes (the code paths, not the
numbers).

The model is captured with its weights on the GPU, so every op's kernel scratch is measured
there (`remat.fx_passes.measuring.scratch`). GPT-2 medium (bf16) has an activation peak of about
half an 80 GB card; the U-Net (fp32, cuDNN) has the largest workspaces. Prints, per budget:
the simulated activation peak, the allocator's peak of a step above its baseline (`step_peak`),
the check, max_memory_reserved above its baseline, the step time (CUDA events), and MFU / HFU
against the card's dense bf16 peak. Exits 0 where there is no CUDA, 1 when a check is missed.

More parts, each a short table:
- **the plan's step against eager**: the plain eager step of the same model (no remat), its
  allocator peak and step time, beside the save-all plan's (a plan that recomputes nothing
  must not cost more than eager);
- **op times against the roofline**: every op of the graph timed alone (CUDA events, median of
  3) against `remat.fx_passes.measuring.timing.roofline` for the target: the total, the median ratio,
  and the ops with the largest measured times;
- **offload**: the save-all schedule with its largest saved tensors kept in host memory where
  the transfer timeline hides them, run with its copies on copy streams: the allocator's peak
  against the simulated device peak (the same contract, within [-2 %, 0 %]), and the measured
  extra step time against the predicted exposed time (`remat.solvers.timeline.overlap`, with
  the link's bandwidth measured here): see benchmarks/_offload_check.py. ``--checks offload``
  runs this check alone; ``--smoke`` runs it on the CPU, on a tiny model, to exercise its code.
- **Inductor**: `benchmarks/inductor.py`'s comparison on CUDA, on its U-Net (or
  `--inductor-model`): torch.compile at activation_memory_budget `--inductor-budgets` beside
  `remat.optimize(..., compile=True)` at each of their measured peaks and at remat's least;
  the check is the allocator at most the plan's peak at most the budget in every remat row (a
  torch.compile point lower on both memory and recompute FLOPs is printed, not counted).
- **applied**, **draws**: eager plans made with compile=True and "blocks", and eager plans of a
  model with dropout against eager's gradients (benchmarks/_applied_check.py, _draws_check.py).
- **kernels** (named alone, not by default): benchmarks/inductor_kernels.py's table on CUDA.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from typing import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from remat.errors import BudgetError  # noqa: E402

GiB = 2**30
# Dense bf16 tensor-core peaks by device-name fragment (vendor datasheets, as in devices.py).
PEAK_BF16 = {"H200": 989.4e12, "H100": 989.4e12, "A100": 312e12, "L4": 121e12, "4090": 165.2e12}


def gpt2_medium(batch: int, seq: int, device: str, tiny: bool = False):
    from transformers import GPT2Config, GPT2LMHeadModel

    size = (dict(n_embd=64, n_layer=2, n_head=4, vocab_size=1000) if tiny else
            dict(n_embd=1024, n_layer=24, n_head=16, vocab_size=50257))
    config = GPT2Config(n_positions=max(1024, seq), attn_implementation="sdpa", **size)
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


def unet(batch: int, size: int, device: str, channels=(32, 64, 128, 256)):
    from tests.models import UNet

    torch.manual_seed(0)
    with torch.device(device):
        model = UNet(channels=channels).train()
        x = torch.randn(batch, 1, size, size)
        y = torch.randn(batch, 1, size, size)
    return model, (x, y)


class Stopwatch:
    """Seconds of the work between `start()` and `stop()`: CUDA events on a GPU, the wall clock
    on the CPU (the dry run's)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def start(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            self.events = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.events[0].record()
        else:
            self.began = time.perf_counter()

    def stop(self) -> float:
        if not self.cuda:
            return time.perf_counter() - self.began
        self.events[1].record()
        torch.cuda.synchronize()
        return self.events[0].elapsed_time(self.events[1]) / 1e3


def timed_steps(step, steps: int, device: torch.device, before=lambda: None,
                after=lambda: None) -> tuple[float, int, int]:
    """(median step seconds, the allocator's largest step peak, the largest rise of
    max_memory_reserved) over `steps` steps after one untimed (compiles, optimizer state)."""
    from remat.fx_passes.measuring.allocator import step_peak

    clock, cuda = Stopwatch(device), device.type == "cuda"
    times, allocated, reserved = [], 0, 0
    for index in range(steps + 1):
        before()
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            base_reserved = torch.cuda.memory_reserved()
            torch.cuda.reset_peak_memory_stats()
        clock.start()
        peak, loss = step_peak(step, lambda out, seed: out.backward(seed), device)
        seconds = clock.stop()
        if index:
            times.append(seconds)
            allocated = max(allocated, peak)
            if cuda:
                reserved = max(reserved, torch.cuda.max_memory_reserved() - base_reserved)
        after()
        del loss
    return sorted(times)[len(times) // 2], allocated, reserved


def run_plan(model, inputs, problem, schedule, steps: int, device: torch.device):
    """(median step seconds, allocator peak, reserved rise) of `schedule` run op by op."""
    from remat.fx_passes.compiled.planned import planned_module

    module = planned_module(model, problem, schedule)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    result = timed_steps(lambda: module(*inputs), steps, device,
                         before=lambda: opt.zero_grad(set_to_none=True), after=opt.step)
    del module, opt
    model.zero_grad(set_to_none=True)
    return result


def run_eager(model, inputs, steps: int, device: torch.device) -> tuple[float, int]:
    """Median step seconds and the allocator's peak of the plain eager step."""
    seconds, peak, _ = timed_steps(lambda: model(*inputs), steps, device,
                                   before=lambda: model.zero_grad(set_to_none=True))
    model.zero_grad(set_to_none=True)
    return seconds, peak


def guarded(name: str, check: Callable[[], bool]) -> bool:
    """Run one part; an exception is printed and counted as a miss, and the next part runs."""
    began = time.perf_counter()
    try:
        ok = bool(check())
    except Exception:  # every part is independent: report and go on
        traceback.print_exc()
        ok = False
        print(f"# part {name}: ERROR (traceback above)", flush=True)
    print(f"# part {name}: {'passed' if ok else 'MISSED'} in {time.perf_counter() - began:.0f} s",
          flush=True)
    return ok


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("gpt2-medium", "unet"), default="gpt2-medium")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--time-limit", type=float, default=60.0)
    parser.add_argument("--checks", nargs="+", choices=PARTS, default=list(PARTS[:-1]),
                        help="the parts to run, in this order (default: all but kernels)")
    parser.add_argument("--inductor-budgets", nargs="+", type=float, default=[0.4, 0.8])
    parser.add_argument("--inductor-model", choices=("unet", "vit", "qwen2", "llama"),
                        default="unet", help="benchmarks/inductor.py's model for that part")
    parser.add_argument("--smoke", action="store_true",
                        help="run the offload check on the CPU on a tiny model (code paths)")
    parser.add_argument("--dry-run", action="store_true",
                        help="every part on the CPU at tiny sizes: the code paths, not the "
                             "numbers (timings and roofline ratios mean nothing there)")
    args = parser.parse_args(argv)
    if args.smoke:
        from _offload_check import smoke

        return smoke()
    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; nothing to check (run it on a GPU machine, or "
              "--dry-run for the code paths on the CPU)")
        return 0
    dev = torch.device("cpu" if args.dry_run else "cuda")
    begin = time.perf_counter()
    name = "CPU (dry run)" if args.dry_run else torch.cuda.get_device_name()
    target = "h200" if "H200" in name else "h100" if "H100" in name else "a100-80gb"
    results = {}
    checks = {"inductor": lambda: inductor_part(dev, args.inductor_model, args.inductor_budgets,
                                                args.time_limit),
              "kernels": lambda: part_of("inductor_kernels", "kernels_part")(dev.type, args.steps),
              "applied": lambda: part_of("_applied_check", "applied_part")(dev.type, args),
              "draws": lambda: part_of("_draws_check", "draws_part")(dev.type, args.time_limit,
                                                                      args.dry_run)}
    if any(p not in checks for p in args.checks):  # the parts on `make_model`'s model
        from remat.fx_passes.lowering.lower import lower
        from remat.fx_passes.tracing.capture import capture

        model, inputs, what = make_model(args, dev)
        captured = capture(model, inputs)
        problem = lower(captured, target=target)  # kernel scratch measured on this device
        scratch = max(n.meta["remat"].get("scratch", 0) for n in captured.graph.nodes
                      if "remat" in n.meta)
        print(f"# {name}: {what}, {len(problem)} ops, largest kernel scratch "
              f"{scratch / 2**20:.1f} MiB, planned in {time.perf_counter() - begin:.0f} s",
              flush=True)
        save_all_seconds = []
        checks.update({
            "plans": lambda: plans_part(model, inputs, problem, args, dev, name,
                                        save_all_seconds),
            "eager": lambda: eager_part(model, inputs, args.steps, dev, save_all_seconds),
            "ops": lambda: ops_part(captured, target, dev),
            "offload": lambda: offload_part(model, inputs, problem, target, args.steps, dev),
        })
    for part in args.checks:
        results[part] = guarded(part, checks[part])
        print(f"# at {time.perf_counter() - begin:.0f} s", flush=True)
    passed = sum(results.values())
    print(f"# total {time.perf_counter() - begin:.0f} s; {passed}/{len(results)} parts passed: "
          + ", ".join(f"{k} {'ok' if v else 'MISSED'}" for k, v in results.items()))
    return 0 if passed == len(results) else 1


PARTS = ("plans", "eager", "ops", "offload", "inductor", "applied", "draws", "kernels")


def make_model(args, dev: torch.device):
    if args.dry_run:  # tiny: every path, in seconds
        if args.model == "unet":
            return (*unet(2, 32, dev, channels=(4, 8)), "U-Net fp32, tiny (dry run)")
        return (*gpt2_medium(2, 32, dev, tiny=True), "GPT-2 bf16, 2 layers (dry run)")
    if args.model == "unet":
        return (*unet(args.batch, args.seq, dev), f"U-Net fp32, batch {args.batch} x {args.seq}^2")
    return (*gpt2_medium(args.batch, args.seq, dev), f"GPT-2 medium bf16, batch {args.batch} "
            f"x {args.seq}")


def plans_part(model, inputs, problem, args, dev, name, save_all_seconds) -> bool:
    """Save-all and two budgets' plans run op by op: the allocator within [-2 %, 0] of the
    simulated peak."""
    from tabulate import tabulate

    from remat.solvers import SolverOptions, solve
    from remat.solvers.core.schedule import drop_unneeded, recomputable
    from remat.solvers.timeline.evaluate import make_schedule
    from remat.solvers.timeline.simulate import simulate

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
    peak = None if args.dry_run else next((v for k, v in PEAK_BF16.items() if k in name), None)
    rows, missed = [], 0
    for label, schedule in plans:
        predicted = simulate(problem, schedule).peak
        seconds, allocated, reserved = run_plan(model, inputs, problem, schedule, args.steps,
                                                dev)
        if label == "save all":
            save_all_seconds.append(seconds)
        hardware_flops = problem.total_flops + schedule.recompute_flops
        ok = 0.98 * predicted <= allocated <= predicted
        missed += not ok
        rows.append([label, len(schedule.recomputed), f"{predicted / GiB:.4f}",
                     f"{allocated / GiB:.4f}",
                     f"{allocated - predicted:+,d} B ({(allocated - predicted) / predicted:+.3%})",
                     "ok" if ok else "MISSED", f"{reserved / GiB:.2f}", f"{seconds * 1e3:.0f}",
                     f"{problem.total_flops / seconds / peak:.1%}" if peak else "-",
                     f"{hardware_flops / seconds / peak:.1%}" if peak else "-"])
        torch._dynamo.reset()
    print(tabulate(rows, headers=["budget", "recomputed", "simulated GiB", "allocator GiB",
                                  "error", "check", "max reserved GiB", "step ms", "MFU", "HFU"],
                   disable_numparse=True), flush=True)
    return not missed  # a budget refused is printed above, not a miss of the check


def eager_part(model, inputs, steps: int, dev, save_all_seconds) -> bool:
    """The plain eager step beside the save-all plan's: no slower than 1.05x."""
    from tabulate import tabulate

    eager_seconds, eager_peak = run_eager(model, inputs, steps, dev)
    if not save_all_seconds:
        print(f"# eager step {eager_seconds * 1e3:.0f} ms, {eager_peak / GiB:.3f} GiB; the "
              "save-all plan did not run (part plans)")
        return False
    plan_seconds = save_all_seconds[0]
    slower = plan_seconds > 1.05 * eager_seconds
    print(tabulate([["eager (no remat)", f"{eager_peak / GiB:.3f}", f"{eager_seconds * 1e3:.0f}"],
                    ["save-all plan", "", f"{plan_seconds * 1e3:.0f}"]],
                   headers=["step", "allocator GiB", "step ms"], disable_numparse=True))
    print(f"# the save-all plan's step is {plan_seconds / eager_seconds:.2f}x eager's "
          f"({'MISSED: over 1.05x' if slower else 'ok'})", flush=True)
    return not slower or dev.type != "cuda"


def ops_part(captured, target: str, dev) -> bool:
    """Every op timed alone against the roofline: printed, not checked."""
    from tabulate import tabulate

    op_rows, measured_total, roofline_total, ratios = time_ops(captured, target, on=dev.type)
    print(tabulate(op_rows, headers=["op", "target", "measured us", "roofline us", "ratio"],
                   disable_numparse=True))
    ratios.sort()
    print(f"# ops: measured {measured_total * 1e3:.1f} ms in all against a roofline of "
          f"{roofline_total * 1e3:.1f} ms ({measured_total / roofline_total:.2f}x); median "
          f"ratio {ratios[len(ratios) // 2]:.2f} over {len(ratios)} timed ops", flush=True)
    return bool(ratios)


def inductor_part(dev: torch.device, model: str, fractions: list[float],
                  time_limit: float) -> bool:
    """benchmarks/inductor.py's `model` on `dev`: torch.compile at `fractions` beside remat
    compiled with Inductor; True when every remat row's allocator <= plan <= budget."""
    import inductor

    inductor.TIME_LIMIT = time_limit
    torch._dynamo.reset()
    rows = inductor.rows_of(inductor.on(inductor.MODELS[model](), dev.type), fractions)
    inductor.verdicts(rows)
    print(inductor.table(rows), flush=True)
    return all(r.verdict.startswith("ok") for r in rows
               if r.runner.startswith("remat") and r.activations >= 0)


def part_of(module: str, name: str) -> Callable[..., bool]:
    """A part kept in a module of its own beside this script (imported when it runs)."""
    return getattr(__import__(module), name)


def offload_part(model, inputs, problem, target: str, steps: int, dev: torch.device) -> bool:
    """The overlapped offload against its prediction (benchmarks/_offload_check.py)."""
    from tabulate import tabulate

    from _offload_check import HEADERS, check_overlapped_offload
    from remat.fx_passes.measuring.devices import device

    row, ok, notes = check_overlapped_offload(model, inputs, problem, steps, dev,
                                              device(target).host_link)
    print(tabulate([row], headers=HEADERS, disable_numparse=True))
    print("\n".join(f"# {n}" for n in notes), flush=True)
    return ok


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
