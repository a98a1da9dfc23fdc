"""Making and keeping plans: `prepare` (capture, measure and lower the step), `plan` (the
compiled mode's `Plan`), `eager_plan` (the eager mode's), `block_compile`, `shapes` (plans for a
shape range), `report` and `offload_report` (what a plan shows), `plan_file` (plans saved and
read). Imports `job`."""
