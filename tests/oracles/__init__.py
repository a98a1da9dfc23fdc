"""Exhaustive searches that judge the solvers: `rich_brute` (and its bounds, the richer execution
model's every schedule of a tiny problem) and `eager_brute` (every eager policy)."""
