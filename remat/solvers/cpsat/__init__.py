"""Strategy `optimal`: the exact CP-SAT model of the execution model in `simulate`.

- `units`: how bytes and seconds become integers (rounded safely), the free model's time axis,
  and the rule both models share (the backward gets what it needs, once);
- `free_model`: recomputations at any backward position (the default);
- `jit_model`: recomputations just in time (`free_positions=False`), hinted by `jit_hint`;
- `search`: CP-SAT's parameters, the anytime trace, the progress line;
- `hints`: the baselines that start the search (the hint pool, `HINT_POOL`) and the drop pass
  (the plan read off the bound's relaxation, `remat.solvers.relaxation.relaxed`, competes with
  them);
- `least_peak`: the least-peak search and the BudgetError it supports;
- `rich_model`: the richer execution model (recompute twice, within the forward, offload),
  its further runs built by `rich_runs`, hinted by `rich_hint`;
- `rich_search`: `SolverOptions.model` "rich" and "auto" (the single model first, the rich one
  where a bound over its space leaves room), which searches the rich model with
  `rich_model_search`;
- `offload_search`: offloads added to a plan where the host link hides them;
- `driver`: `optimal` itself, its deadline and its stages;
- `tiled`: Strategy `tiled`, long stacks solved window by window with `optimal`.

The eager mode's exact planner is `remat.solvers.eager`, one floor up.
"""
from remat.solvers.cpsat.driver import optimal
from remat.solvers.cpsat.hints import BASELINES, HINT_POOL, _best_baseline

__all__ = ["BASELINES", "HINT_POOL", "optimal", "_best_baseline"]
