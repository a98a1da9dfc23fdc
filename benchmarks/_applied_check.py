"""gpu_check's `applied` part: eager plans read under torch.compile, by the allocator.

On one of benchmarks/inductor.py's models (its Qwen2 by default): plain eager and plain
``torch.compile`` (no remat) for reference, then ``remat.optimize(model, activation_budget=B,
execution="eager", compile=how)`` for how in (True, "blocks"), B a fraction of plain eager's
activation peak; then torch.compile at each ``--inductor-budgets`` fraction of its
activation_memory_budget, and compile=True at the peak each read (a torch.compile row lower
on both memory and recompute FLOPs is named in the verdict, not counted). Each plan's `module` (torch.compile of the applied model, or the model with
each block compiled) runs on a fresh copy of the weights and is read by the allocator
(``max_memory_allocated`` on CUDA, the profiler's memory events on the CPU), the third step.
The check: allocator <= the plan's peak (its own reading while planning) <= budget. Printed
beside it: the eager timeline's prediction of the same plan, the recompute FLOPs, and the
fastest step over plain eager's.

    python benchmarks/gpu_check.py --checks applied [--inductor-model qwen2]
        [--inductor-budgets 0.4 0.8]
"""
from __future__ import annotations

import copy

import torch
from tabulate import tabulate

import remat
from remat.solvers import SolverOptions

MIB = 2**20
FRACTION = 0.6  # of plain eager's activation peak: the plans recompute


def applied_table(case, time_limit: float, fraction: float = FRACTION,
                  compile_fractions=()) -> tuple[str, bool]:
    """(the table, whether every plan row kept allocator <= plan <= budget). Also torch.compile
    at each of `compile_fractions` (its activation_memory_budget) and the plan made with
    compile=True at what each read."""
    import inductor

    torch._dynamo.reset()
    eager_peak, eager = inductor.plain_eager(fresh(case))
    rows = [["eager", f"{eager_peak / MIB:.2f}", "", "", "", "1.00x", ""]]
    plain = fresh(case)
    peak, ratio = inductor.measure(plain, torch.compile(plain.model), eager)
    rows.append(["torch.compile", f"{peak / MIB:.2f}", "", "", "", f"{ratio:.2f}x", ""])
    budget, ok = int(fraction * eager_peak), True
    runs = [(how, budget, None) for how in (True, "blocks")]
    for point in compile_fractions:  # torch.compile's knob, and remat at what it reads
        peer = inductor.torch_compile_row(fresh(case), point, eager)
        rows.append([peer.runner, f"{peer.activations / MIB:.2f}", "", "",
                     f"{peer.recompute / 1e9:.2f}", f"{peer.step:.2f}x", ""])
        runs.append((True, peer.activations, peer))
    for how, budget, peer in runs:
        torch._dynamo.reset()
        mine = fresh(case)
        label = f"remat eager, compile={how!r} @ {budget / MIB:.2f}"
        try:
            plan = remat.optimize(mine.model, activation_budget=budget, example_inputs=mine.args,
                                  example_kwargs=mine.kwargs, execution="eager", compile=how,
                                  solver_options=SolverOptions(time_limit=time_limit))
        except remat.RematError as e:  # BudgetError included: the row says why
            print(f"# {label}: {e}", flush=True)
            rows.append([label, "", "", "", "", "", str(e).splitlines()[0][:120]])
            ok = False
            continue
        peak, ratio = inductor.measure(mine, plan.module, eager)
        within = peak <= plan.activation_peak <= budget
        ok &= within
        beaten = peer is not None and peer.activations < peak and \
            peer.recompute < plan.recompute_flops
        rows.append([label, f"{peak / MIB:.2f}", f"{plan.activation_peak / MIB:.2f}",
                     f"{plan.inductor.predicted / MIB:.2f}", f"{plan.recompute_flops / 1e9:.2f}",
                     f"{ratio:.2f}x", ("ok" if within else "MISSED") +
                     (f"; dominated by {peer.runner}" if beaten else "")])
    table = tabulate(rows, headers=["runner", "allocator MiB", "plan MiB", "eager timeline MiB",
                                    "recompute GFLOP", "step / eager", "verdict"])
    return f"# {case.name}: eager plans under torch.compile\n{table}", ok


def applied_part(device: str, args) -> bool:
    """The part: inductor.py's `args.inductor_model` on `device` (a 2-layer Qwen2 of hidden 64
    in a dry run, on the CPU: the code paths), torch.compile at `args.inductor_budgets`;
    prints the table, True when every plan row is ok."""
    import inductor

    if args.dry_run:
        from inductor_kernels import qwen2

        model_, kwargs = qwen2(2, 64, 32)
        case = inductor.Case("qwen2 (dry run)", model_, (), kwargs)
    else:
        case = inductor.on(inductor.MODELS[args.inductor_model](), device)
    table, ok = applied_table(case, args.time_limit, compile_fractions=args.inductor_budgets)
    print(table, flush=True)
    return ok


def fresh(case):
    """`case` with a copy of its model (a plan applies in place)."""
    return type(case)(case.name, copy.deepcopy(case.model), case.args, case.kwargs)
