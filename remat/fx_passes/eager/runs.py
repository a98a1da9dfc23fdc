"""A module run several times in one step (ALBERT's shared layer) is a block per run: the
planner names them ``path#k`` (`run_name`), and the applied module gives its k-th call of a
step the k-th run's policy (`remat.fx_passes.eager.apply`).

The probe marks where each call began in the block's observed ops (`Observed.calls`);
`split_runs` cuts the block's aligned policy there and assigns its joint-graph ops and
backward ops to the runs. A saved plan's policies are already cut: `joined_runs` puts them
back together, so that the same split gives the same blocks.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Sequence

from torch import fx

from remat.fx_passes.eager.block_policy import BlockPolicy
from remat.solvers.core.problem import Problem

__all__ = ["joined_runs", "module_path", "run_index", "run_name", "split_runs"]


def run_name(path: str, call: int) -> str:
    """The block of the `call`-th run of the module at `path` in a step."""
    return f"{path}#{call}"


def module_path(name: str) -> str:
    """The module a block name (a path, or a run's `run_name`) wraps."""
    head, sep, tail = name.rpartition("#")
    return head if sep and tail.isdigit() else name


def run_index(name: str) -> int | None:
    """Which run of its module a block name is (None: the module runs once)."""
    head, sep, tail = name.rpartition("#")
    return int(tail) if sep and tail.isdigit() else None


def split_runs(problem: Problem, nodes: list[fx.Node], path: str, calls: Sequence[int],
               ops: dict[str, list[int]], owner: dict[int, str],
               policies: dict[str, BlockPolicy]) -> None:
    """Make block `path`, whose module ran once per entry of `calls` (where each call began
    in its aligned policy), one block per call (`run_name`), in `ops`, `owner` and
    `policies`: each joint op goes to the call its matched eager op ran in (an unmatched one
    to the call of the op before it), each backward op to the call whose forward op has its
    autograd sequence number (one without to the call of the backward op before it)."""
    policy, members = policies.pop(path), ops.pop(path)
    bounds = list(calls) + [len(policy.ops)]
    call_of: dict[int, int] = {}
    for k in range(len(calls)):
        for joint in policy.joint[bounds[k]:bounds[k + 1]]:
            call_of.update((j, k) for j in joint)
    runs: list[list[int]] = [[] for _ in calls]
    current = 0
    for v in members:
        current = call_of.get(v, current)
        runs[current].append(v)
    for k, run in enumerate(runs):
        mine = set(run)
        ops[run_name(path, k)] = run
        a, b = bounds[k], bounds[k + 1]
        policies[run_name(path, k)] = replace(
            policy, ops=policy.ops[a:b], joint=policy.joint[a:b],
            cacheable=policy.cacheable[a:b],
            made_after=tuple(pair for pair in policy.made_after if pair[0] in mine),
            life=tuple(pair for pair in policy.life if pair[0] in mine),
            eager_bytes=tuple(pair for pair in policy.eager_bytes if pair[0] in mine),
            cache=frozenset(c - a for c in policy.cache if a <= c < b),
            keep=frozenset(c - a for c in policy.keep if a <= c < b))
    by_seq = {nodes[v].meta.get("seq_nr"): k for k, run in enumerate(runs) for v in run}
    by_seq.pop(None, None)
    current = len(calls) - 1  # the backward runs the last call's nodes first
    for b in sorted(b for b, name in owner.items() if name == path):
        current = by_seq.get(nodes[b].meta.get("seq_nr"), current)
        owner[b] = run_name(path, current)


def joined_runs(policies: dict[str, BlockPolicy]
                ) -> tuple[dict[str, BlockPolicy], dict[str, tuple[int, ...]]]:
    """`policies` with each module's runs (``path#k``) joined into one policy for `path`,
    and where each run began in it: what `split_runs` takes to cut them again."""
    joined: dict[str, Any] = {}
    for name, policy in policies.items():
        k = run_index(name)
        if k is None:
            joined[name] = policy
        else:
            joined.setdefault(module_path(name), {})[k] = policy
    calls: dict[str, tuple[int, ...]] = {}
    for path, runs in joined.items():
        if isinstance(runs, BlockPolicy):
            continue
        ordered = [runs[k] for k in sorted(runs)]
        starts = [0]
        for run in ordered[:-1]:
            starts.append(starts[-1] + len(run.ops))
        calls[path] = tuple(starts)
        joined[path] = replace(
            ordered[0], ops=sum((r.ops for r in ordered), ()),
            joint=sum((r.joint for r in ordered), ()),
            cacheable=sum((r.cacheable for r in ordered), ()),
            made_after=sum((r.made_after for r in ordered), ()),
            life=sum((r.life for r in ordered), ()),
            eager_bytes=sum((r.eager_bytes for r in ordered), ()),
            cache=frozenset(s + c for s, r in zip(starts, ordered) for c in r.cache),
            keep=frozenset(s + c for s, r in zip(starts, ordered) for c in r.keep))
    return joined, calls
