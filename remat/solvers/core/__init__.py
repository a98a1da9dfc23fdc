"""The contract every floor above shares: the `Problem` (ops, their bytes, seconds and FLOPs,
who reads what), the `Schedule` (which values the backward recomputes, again or offloads, and
`decide`, which derives what is saved and checks that it can run), `SolverOptions`, the
`Deadline` every stage shares, the objective (seconds or FLOPs), the strategies by name, the
blocks of a problem and the problem file. The lowest floor of `remat.solvers`."""
