"""A zoo architecture's eager plan under torch.compile, backend by backend: where the
`--inductor` rows of examples/hf_zoo.py read above the eager prediction, which part of the
compiled step holds the excess.

    python benchmarks/compile_applied_zoo.py ARCH BACKENDS [nodrop]
    python benchmarks/compile_applied_zoo.py convnext aot_eager,inductor,inductor-nolayout

The architecture is built and its eager plan made as examples/hf_zoo.py makes it (the same
budget: half-way between per-block checkpointing and saving everything; the solve may return
another plan of the budget, whose prediction is printed), applied to a fresh copy, then
`torch.compile` with each backend (`inductor-nolayout`: Inductor with
``layout_optimization=False``; `fallback_random` on throughout, as in the zoo's rows). Printed:
the allocator's activation peak (third step) against the eager prediction, and the bytes and
count of the distinct storages the compiled forwards save for their backwards, parameters
left out (saved_tensors_hooks on AOTAutograd's autograd.Function; inputs, buffers and
constants held before the step included: a comparison of backends, not of the prediction).
`nodrop` sets every dropout probability of the model to 0 before planning: another model,
planned at its own budget."""
import copy
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from examples.hf_zoo import _plan, activation_peak, budget_range, training_step  # noqa: E402
from examples.zoo_models import build  # noqa: E402
from remat.planner.plans.eager_plan import eager_structure  # noqa: E402
from remat.planner.plans.prepare import prepare  # noqa: E402
from remat.solvers import SolverOptions  # noqa: E402

name = sys.argv[1]
backends = sys.argv[2].split(",")
base, kwargs = build(name)
if len(sys.argv) > 3 and sys.argv[3] == "nodrop":
    n = 0
    for mod in base.modules():
        if isinstance(mod, torch.nn.Dropout):
            mod.p = 0.0
            n += 1
        for k, v in list(vars(mod).items()):
            if "dropout" in k and isinstance(v, float):
                setattr(mod, k, 0.0)
                n += 1
    print("dropout zeroed:", n)
prepared = prepare(copy.deepcopy(base), example_kwargs=kwargs)
eager = eager_structure(copy.deepcopy(base), prepared, None, (), kwargs)[:2]
lo, hi = budget_range("eager", prepared, eager)
budget = max(int(lo + 0.5 * (hi - lo)), lo)
m = copy.deepcopy(base)
plan, call = _plan("eager", m, prepared, kwargs, budget, SolverOptions(time_limit=5))
print(name, "budget", budget, "predicted", plan.activation_peak)
step = training_step(call, kwargs, 7)
step()
print("eager applied", activation_peak(step, m))


def saved_bytes(step, model):
    """Distinct storages saved for the backward, the parameters' left out (state)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        if isinstance(t, torch.Tensor):
            s = t.untyped_storage()
            if s.data_ptr() not in params:
                seen[s.data_ptr()] = s.nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step()
    return sum(seen.values()), len(seen)

for b in backends:
    torch._dynamo.reset()
    mm = plan.apply(copy.deepcopy(base))
    c = torch.compile(mm, backend=b.split("-")[0])
    t = time.time()
    extra = {"layout_optimization": False} if b.endswith("-nolayout") else {}
    with torch._inductor.config.patch(fallback_random=True, **extra):
        step = training_step(c, kwargs, 7)
        step()
        step()
        peak = activation_peak(step, mm)
        over = 100 * (peak - plan.activation_peak) / plan.activation_peak
        print(b, "applied", peak, f"{over:+.2f} %", "saved (bytes, tensors)",
              saved_bytes(step, mm), f"{time.time() - t:.0f} s", flush=True)
