"""The exact solver's single model against "auto" (the rich model where a bound over its space
leaves room), per problem and budget: cost, status, bound, seconds, which model answered.
Run: PYTHONPATH=$PWD python benchmarks/rich_vs_single.py [time_limit]"""
import time, pathlib, sys
from remat.solvers.problem_file import loads
from remat.solvers import solve
from remat.solvers.options import SolverOptions
from remat.solvers.synthetic import unet, transformer
from remat.solvers.schedule import make_schedule
from remat.errors import BudgetError
from tests.test_rich_solver import long_skip
probs = [("long_skip(10,2,5)", long_skip(10,2,5), None), ("long_skip(20,5,1)", long_skip(20,5,1), None)]
for name in ("unet3", "chain12", "transformer2_nodrop"):
    p, extra = loads(pathlib.Path(f"tests/regression/{name}.json").read_text()); probs.append((name, p, extra["options"]))
probs.append(("unet(depth=3)", unet(depth=3), None))
probs.append(("transformer(layers=2)", transformer(layers=2), None))
limit = float(sys.argv[1]) if len(sys.argv) > 1 else 20
for name, p, extra in probs:
    extra = extra or {}
    full = make_schedule(p, set()).peak
    try: solve(p, 0, "optimal", SolverOptions(workers=2, time_limit=limit, model="single", **extra)); least = 0
    except BudgetError as e: least = e.smallest
    for frac in (0.0, 0.5):
        b = int(least + frac * (full - least))
        if name.startswith("long_skip"): b = {"long_skip(10,2,5)": 23, "long_skip(20,5,1)": 27}[name] if frac == 0 else 40
        cells = []
        for model in ("single", "auto"):
            t = time.perf_counter()
            try:
                r = solve(p, b, "optimal", SolverOptions(workers=2, time_limit=limit, model=model, **extra))
                cells.append(f"{model}: cost {r.cost:.4g} {r.status.value} bound {r.bound:.4g} {time.perf_counter()-t:.2f}s [{r.info.get('model')}; {r.info.get('rich', '')}]")
            except BudgetError:
                cells.append(f"{model}: BudgetError {time.perf_counter()-t:.2f}s")
        print(f"{name} n={len(p)} budget={b} ({frac:.0%} between single's least peak and save-all) | " + " | ".join(cells), flush=True)
