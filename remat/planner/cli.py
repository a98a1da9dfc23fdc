"""The `remat` command: `remat plan PATH_OR_MODULE:FACTORY --budget 60GB ...` and `remat demo`.

The CLI prints; the library logs (progress of the long phases goes to stderr through logging).
A FACTORY is a callable of no arguments returning `(model, example_inputs)` or
`(model, example_inputs, example_kwargs)`. MODULE is found as ``python -m`` finds it, the
working directory first.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

from remat.errors import RematError
from remat.planner.job.budget import ACCEPTED, parse_size
from remat.planner.job.training import Training

log = logging.getLogger(__name__)


def load_factory(spec: str) -> Callable[[], Any]:
    """"examples/llama.py:tiny" or "examples.llama:tiny" -> the callable it names."""
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name:
        raise ValueError(f"cannot read {spec!r}: give PATH.py:FACTORY or MODULE:FACTORY")
    if where.endswith(".py") or "/" in where or "\\" in where:
        path = Path(where)
        if not path.is_file():
            raise ValueError(f"{spec!r}: no file {where}")
        module_spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(module_spec)
        sys.modules.setdefault(path.stem, module)
        try:
            module_spec.loader.exec_module(module)
        except ImportError as e:
            raise ValueError(f"{spec!r}: importing {where} failed: {_import_failure(e)}") \
                from e
    else:
        module = _import_module(spec, where)
    factory = getattr(module, name, None)
    if not callable(factory):
        raise ValueError(f"{spec!r}: {where} has no callable {name!r}")
    return factory


def _import_module(spec: str, where: str) -> Any:
    """The module `where`, found as ``python -m`` finds it: the working directory first on the
    path (a console script's path starts at its own folder instead, so ``remat plan
    mymodel:build`` would not find mymodel.py beside the user). A failed import is a
    ValueError naming the module and the remedy."""
    here = os.getcwd()
    if here not in sys.path and "" not in sys.path:
        sys.path.insert(0, here)
    try:
        return importlib.import_module(where)
    except ImportError as e:
        missing = getattr(e, "name", None)
        if isinstance(e, ModuleNotFoundError) and missing and \
                (where == missing or where.startswith(missing + ".")):
            top = where.split(".")[0]
            raise ValueError(
                f"{spec!r}: no module named {where!r} in the working directory ({here}) nor "
                f"on the Python path: run remat in the folder that holds {top}.py (or the "
                f"package {top}/), add that folder to PYTHONPATH, or give the file: "
                f"PATH.py:{spec.rpartition(':')[2]}") from e
        raise ValueError(f"{spec!r}: importing module {where!r} failed: "
                         f"{_import_failure(e)}") from e


def _import_failure(error: ImportError) -> str:
    missing = getattr(error, "name", None)
    if isinstance(error, ModuleNotFoundError) and missing:
        return (f"it imports {missing!r}, which is not installed here: install it (or fix "
                "the import)")
    return f"{type(error).__name__}: {error}"


FACTORY_RETURNS = ("(model, example_inputs) or (model, example_inputs, example_kwargs): an "
                   "nn.Module, a tuple of its positional inputs (one tensor is taken as a "
                   "1-tuple), and a dict of its keyword inputs")


def call_factory(spec: str, factory: Callable[[], Any]) -> tuple[Any, tuple, dict]:
    """What `factory()` returns, checked: (model, example_inputs, example_kwargs)."""
    import torch

    result = factory()
    parts = result if isinstance(result, (tuple, list)) else (result,)
    if not 2 <= len(parts) <= 3 or not isinstance(parts[0], torch.nn.Module):
        got = (f"a {type(result).__name__} of {len(parts)} "
               f"({', '.join(type(x).__name__ for x in parts[:4])})"
               if isinstance(result, (tuple, list)) else f"only a {type(result).__name__}")
        raise ValueError(f"{spec!r} returned {got}; a factory must return {FACTORY_RETURNS}")
    model, inputs = parts[0], parts[1]
    kwargs = parts[2] if len(parts) == 3 else {}
    if isinstance(inputs, torch.Tensor):
        inputs = (inputs,)
    if not isinstance(inputs, (tuple, list)) or not isinstance(kwargs, dict):
        raise ValueError(f"{spec!r} returned example_inputs of type {type(inputs).__name__} "
                         f"and example_kwargs of type {type(kwargs).__name__}; a factory must "
                         f"return {FACTORY_RETURNS}")
    return model, tuple(inputs), kwargs


def parse_training(text: str | None) -> Training:
    """"precision=bf16-mixed,optimizer=adamw,zero_stage=1,data_parallel=8" -> Training."""
    if not text:
        return Training()
    fields: dict[str, Any] = {}
    for item in text.split(","):
        key, sep, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep:
            raise ValueError(f"--training: {item!r} is not KEY=VALUE")
        if key in ("data_parallel", "zero_stage", "prefetch", "backward_prefetch"):
            fields[key] = int(value)
        elif key == "fragmentation":
            fields[key] = float(value)
        elif key == "frozen":
            fields[key] = frozenset(value.split("+"))
        else:
            fields[key] = value.strip()
    try:
        return Training(**fields)
    except TypeError as e:
        raise ValueError(f"--training: {e}") from None


def _parser() -> argparse.ArgumentParser:
    from remat.fx_passes.measuring.devices import DEVICES
    from remat.solvers import Strategy

    parser = argparse.ArgumentParser(prog="remat", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug detail")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")
    sub = parser.add_subparsers(dest="command", required=True)

    plan = sub.add_parser("plan", help="plan a model's training step for a memory budget")
    plan.add_argument("factory", help=f"PATH.py:FACTORY or MODULE:FACTORY returning "
                                      f"{FACTORY_RETURNS}".replace("%", "%%"))
    budgets = plan.add_mutually_exclusive_group(required=True)
    budgets.add_argument("--budget", help=f"whole-step memory per device: {ACCEPTED}")
    budgets.add_argument("--activation-budget", help="bound the activations alone")
    plan.add_argument("--target", default="h100", metavar="TARGET",
                      help="device whose speed the cost model uses: "
                           f"{', '.join(sorted(DEVICES))} (default h100)")
    plan.add_argument("--training", help="KEY=VALUE,...: precision (fp32, bf16-mixed, bf16, "
                                         "fp16, autocast), optimizer (adam, adamw, sgd, "
                                         "sgd_momentum, lion, adafactor, adam8bit), "
                                         "data_parallel, zero_stage, reserve, fragmentation, "
                                         "frozen (patterns joined by +)")
    plan.add_argument("--solver", default="optimal", choices=[s.value for s in Strategy],
                      metavar="SOLVER", help="strategy: "
                      f"{', '.join(s.value for s in Strategy)} (default optimal)")
    plan.add_argument("--time-limit", type=float, default=None,
                      help="seconds per solve (default: chosen by the problem's size)")
    plan.add_argument("--objective", choices=("time", "flops"), default="time",
                      help="minimize recompute time on --target (default) or recompute FLOPs")
    plan.add_argument("--sweep", action="store_true",
                      help="also the trade-off curve: one plan per budget")
    plan.add_argument("--budgets", help="budgets of the sweep, comma-separated (default: eight "
                                        "from checkpoint-every-block's peak to save-all's)")
    plan.add_argument("--json", metavar="FILE", help="write the plan's figures and report "
                                                     "(and the sweep) as JSON, for tools")
    plan.add_argument("--out", metavar="FILE", help="write the plan as a plan file, which "
                                                    "remat.load_plan(FILE, model) loads "
                                                    "onto the model without solving")
    plan.add_argument("--plot", metavar="FILE", help="with --sweep: a PNG of the curve")

    demo = sub.add_parser("demo", help="plan a 7B model on meta tensors for an 80 GB device, "
                                       "then plan and run one step of a small GPT on the CPU")
    demo.add_argument("--time-limit", type=float, default=None,
                      help="seconds per solve (default: chosen by the problem's size)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    level = logging.DEBUG if args.verbose else logging.WARNING if args.quiet else logging.INFO
    logging.basicConfig(level=level, stream=sys.stderr, format="remat: %(message)s")
    try:
        if args.command == "demo":
            from remat.planner.demo import run_demo
            return run_demo(time_limit=args.time_limit)
        return _plan(args)
    except (RematError, ValueError, KeyError) as e:
        message = e.args[0] if isinstance(e, KeyError) and e.args else e
        print(f"remat: error: {type(e).__name__}: {message}", file=sys.stderr)
        return 2


def _plan(args: argparse.Namespace) -> int:
    from remat.planner.plans.plan import plan_prepared
    from remat.planner.plans.prepare import prepare
    from remat.planner.sweep import default_budgets, sweep_prepared
    from remat.solvers import SolverOptions

    training = parse_training(args.training)
    options = SolverOptions(time_limit=args.time_limit, objective=args.objective)
    model, example_inputs, example_kwargs = call_factory(args.factory,
                                                         load_factory(args.factory))
    budget = parse_size(args.budget) if args.budget else None
    activation_budget = (parse_size(args.activation_budget, allow_zero=True)
                         if args.activation_budget else None)
    prepared = prepare(model, example_inputs, example_kwargs=example_kwargs, training=training,
                       target=args.target)
    plan = plan_prepared(model, prepared, budget=budget, activation_budget=activation_budget,
                         target=args.target, solver=args.solver, solver_options=options)
    print(plan.report().render())
    out = {"plan": plan.to_dict()}
    if args.sweep:
        budgets = ([parse_size(b) for b in args.budgets.split(",")] if args.budgets
                   else default_budgets(prepared))
        result = sweep_prepared(model, prepared, budgets, target=args.target,
                                solver=args.solver, solver_options=options)
        print("\nThe trade-off curve")
        print(result.render())
        if args.plot:
            print(result.plot(args.plot))
        out["sweep"] = result.to_dict()
    elif args.plot:
        print("no plot: --plot draws the sweep; add --sweep")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
        print(f"plan written to {args.json}")
    if args.out:
        plan.save(args.out)
        print(f"plan file written to {args.out}: remat.load_plan({args.out!r}, model)")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
