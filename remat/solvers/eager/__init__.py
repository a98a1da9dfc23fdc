"""The eager mode's planners, over `remat.solvers.timeline.eager`: `heuristic` (repair and
improve from seed cache sets, and the offloads), and the exact CP-SAT planner: `decisions`,
`conditions`, `count` and `slots` (what a policy decides, its conditions, the counted runs
and the relaxation at a few slots), `model` (the exact model, its storage holds in
`storage`) and `search` (its driver).
The highest floor under `remat.solvers.entry`."""
