"""Strategies a user can name besides the exact one: `standard` (save everything, checkpoint
every block, Chen's sqrt(n), greedy, selective; the exact search starts from them) and
`brute_force` (every schedule of a tiny problem). Imports `core` and `timeline`."""
