"""Lower bounds and the plans read off them: `relaxation` (the problem at a few joined steps,
solved as a small CP-SAT model), `bound` (peak and cost bounds), `relaxed` and `rich_relaxed`
(plans read off a relaxation), `repair` and `second_runs` (a plan that does not fit mended by
recomputing more, or running a value a second time). Imports `core`, `timeline`, `baselines`."""
