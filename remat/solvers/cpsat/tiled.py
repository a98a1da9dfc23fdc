"""The tiled strategy: solve one block of each repeated family exactly, tile the plans onto every
identical block, and fit the whole step with the simulator's peak as the judge.

Why it scales: under one plan per block, a stack of L identical blocks peaks near the start of
the backward at about (L - 1) * S + W, where S is what one block saves and W the working set of
one block's backward. So what a block plan is worth is its cost against its S. The block's
sub-problem (`remat.solvers.core.blocks.subproblem`) bounds S with its `hold` scratch; exact solves
at a few allowances give the block's frontier of (S, cost) plans, each from a ~50-op solve
whatever L is. Then, with every tiling judged on the whole step by `PeakMeter`:
1. every block takes the cheapest plan that fits when all take it;
2. the blocks nearest the loss take a cheaper plan, as many as fit (a bisection on their
   number): the next plan on the lower convex hull of (S, cost), which mixes best (see
   `lower_hull`), and the next plan by cost. The peak at the start of the backward holds every
   block's saved bytes but the last's whatever the mix; earlier in the backward, fewer of the
   heavier blocks are held;
3. block by block, the two ends first (the last block's saved bytes stack under no other
   block's backward), the cheapest plan that still fits, for as many evaluations as allowed.
Plans for allowances of a block's own peak join those for allowances of S: in short stacks, one
block's W is most of the peak.
Values outside the families (embeddings, the head) are saved. Without repeated blocks the
strategy saves everything, and says so when that does not fit.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from remat.errors import BudgetError, SolverError
from remat.solvers.core.blocks import Family, Sub, families, subproblem
from remat.solvers.core.options import SolverOptions
from remat.solvers.timeline.peak_meter import PeakMeter
from remat.solvers.core.problem import Problem
from remat.solvers.cpsat.driver import optimal
from remat.solvers.core.strategy import Strategy
from remat.solvers.core.schedule import Schedule, Status
from remat.solvers.timeline.evaluate import make_schedule

logger = logging.getLogger(__name__)

# Exact block solves per family: allowances evenly spread between the least S and saving all.
ALLOWANCES = 12
# Seconds each exact block solve may take at most, and the share of the time limit it may.
SUB_SOLVE_CAP = 2.0
SUB_SOLVE_SHARE = 1 / 40
# Whole-step evaluations the block-by-block pass may spend per family, each O(ops): every block
# of a short stack, the ends and a few more of a tall one.
LOCAL_EVALUATIONS = 32


@dataclass(frozen=True)
class Plan:
    """A block plan: the positions (in the block) it recomputes, what one block then saves
    (bytes held from its forward to its backward) and what it costs."""

    positions: frozenset[int]
    saved: int
    cost: float


def block_plans(problem: Problem, family: Family, options: SolverOptions,
                deadline: float) -> list[Plan]:
    """Exact plans of the family's representative block, by S ascending: for allowances of
    what it saves (its sub-problem with `hold` scratch), and for allowances of its own peak (its
    plain sub-problem), which decides in short stacks where one block's W is most of the peak."""
    ops = family.members[family.representative]
    plain = subproblem(problem, ops)
    # Scratch as large as the block's own peak: at a sub-budget of hold + x, a plan holds at
    # most about x at the end of the forward and may peak in the backward as saving all does.
    held = subproblem(problem, ops, hold=make_schedule(plain.problem, []).peak)
    found = {_plan(family, held, ())}
    for sub, count in ((held, ALLOWANCES), (plain, ALLOWANCES // 2)):
        found |= _ladder(family, sub, count, options, deadline)
    return sorted(found, key=lambda p: (p.saved, p.cost))


def _ladder(family: Family, sub: Sub, count: int, options: SolverOptions,
            deadline: float) -> set[Plan]:
    """The cheapest plans of `sub` at `count` budgets from its least peak to saving all."""
    found: set[Plan] = set()
    high = make_schedule(sub.problem, []).peak
    if time.perf_counter() > deadline:
        return found
    try:
        # Free positions: the least-peak search finds the least peak in a fraction of the time.
        optimal(sub.problem, 0, SolverOptions(
            time_limit=options.time_limit, workers=options.workers, seed=options.seed,
            deterministic=options.deterministic))
        return found
    except BudgetError as e:
        low = e.smallest if e.smallest is not None else high
        if e.schedule is not None:
            found.add(_plan(family, sub, e.schedule.recomputed))
    except SolverError:
        return found
    for step in range(count):
        if time.perf_counter() > deadline or low >= high:
            break
        budget = low + (high - low) * step // (count - 1)
        try:
            found.add(_plan(family, sub, optimal(sub.problem, budget,
                                               options).recomputed))
        except (BudgetError, SolverError):
            continue
    return found


def lower_hull(plans: list[Plan]) -> list[int]:
    """Indices of the plans (sorted by S) on the lower convex hull of (saved, cost). Mixing
    two neighbours on it, some blocks on each, beats any plan between them at the same total
    S: on `synthetic.transformer(layers=38)` at 70 % of the save-all peak, plans saving 280 MB
    and 392 MB per block, mixed, cost 4.93 ms, where mixes of the plans between them (304 and
    312 MB) cost 5.34 ms."""
    hull: list[int] = []
    for i, p in enumerate(plans):
        while len(hull) >= 2:
            a, b = plans[hull[-2]], plans[hull[-1]]
            # b lies on or above the segment from a to p: not a vertex of the lower hull.
            if (b.cost - a.cost) * (p.saved - a.saved) >= (p.cost - a.cost) * (b.saved - a.saved):
                hull.pop()
            else:
                break
        hull.append(i)
    return hull


def _plan(family: Family, sub: Sub, recomputed) -> Plan:
    schedule = make_schedule(sub.problem, recomputed)
    saved = sum(sub.problem.ops[s].size for s in schedule.saved if sub.ops[s] is not None)
    positions = family.positions(family.representative, sub.lift(schedule.recomputed))
    return Plan(frozenset(positions), saved, schedule.cost)


def tiled(problem: Problem, budget: int, options: SolverOptions) -> Schedule:
    options = options.by_size(len(problem))
    deadline = time.perf_counter() + options.time_limit
    save_all = make_schedule(problem, [], strategy=Strategy.TILED.value,
                             status=Status.HEURISTIC, budget=budget)
    if save_all.peak <= budget:  # nothing to recompute: no block needs solving
        return save_all
    return Tiler(problem, options, deadline).fit(budget, deadline)


class Tiler:
    """The block plans of a problem, solved once, and tilings of them judged on the whole step
    at any budget (`fit`): a sweep over budgets solves the blocks once."""

    def __init__(self, problem: Problem, options: SolverOptions, deadline: float | None = None):
        options = options.by_size(len(problem))
        deadline = time.perf_counter() + options.time_limit if deadline is None else deadline
        self.problem = problem
        self.families = families(problem)
        per_solve = min(SUB_SOLVE_CAP, max(0.2, options.time_limit * SUB_SOLVE_SHARE))
        sub_options = SolverOptions(time_limit=per_solve, workers=options.workers,
                                    seed=options.seed, free_positions=False,
                                    deterministic=options.deterministic,
                                    cost_resolution=options.cost_resolution)
        self.plans = [block_plans(problem, f, sub_options, deadline) for f in self.families]
        self.meter = PeakMeter(problem)
        self.seen: dict[frozenset[int], tuple[float, int]] = {}  # decision: (cost, peak)
        self._tilings: dict[tuple, frozenset[int]] = {}  # tiling: decision

    def fit(self, budget: int, deadline: float = float("inf")) -> Schedule:
        """The cheapest tiling found that fits `budget`; BudgetError when none does."""
        if not self.families:
            schedule = make_schedule(self.problem, [], strategy=Strategy.TILED.value,
                                     status=Status.HEURISTIC, budget=budget)
            if schedule.peak > budget:
                raise BudgetError(
                    f"tiled: the step has no repeated blocks (modules whose paths end in a list "
                    f"index, with identical ops), so it saves everything, which peaks at "
                    f"{schedule.peak:,} bytes, above the budget of {budget:,}; try the optimal "
                    "strategy or a larger budget", budget=budget, smallest=schedule.peak)
            return schedule
        evaluated = len(self.seen)
        cost, peak, decision, _ = self._search(budget, deadline)
        logger.debug("tiled: %d families, cost %.3g, peak %d", len(self.families), cost, peak)
        return make_schedule(self.problem, decision, strategy=Strategy.TILED.value,
                             status=Status.HEURISTIC, budget=budget,
                             info={"blocks": [len(f.members) for f in self.families],
                                   "block_plans": [len(p) for p in self.plans],
                                   "tilings_evaluated": len(self.seen) - evaluated})

    def evaluate(self, tiling: list[list[int]]) -> tuple[float, int, frozenset[int]]:
        """Cost, simulated peak and decision of a tiling: for each family, the index of each
        block's plan."""
        key = tuple(map(tuple, tiling))
        if key not in self._tilings:
            chosen: set[int] = set()
            for family, plans, choice in zip(self.families, self.plans, tiling):
                for k, index in enumerate(choice):
                    chosen |= family.tile(k, plans[index].positions)
            decision = frozenset(self.meter.drop_unneeded(chosen))
            if decision not in self.seen:
                self.seen[decision] = (self.meter.cost(decision), self.meter.peak(decision))
            self._tilings[key] = decision
        decision = self._tilings[key]
        return (*self.seen[decision], decision)

    def _search(self, budget: int, deadline: float):
        """One family at a time, the later ones on their plan of least S meanwhile."""
        best = (0.0, 0, frozenset(), [[0] * len(f.members) for f in self.families])
        for f in range(len(self.families)):
            best = self._family(best[3], f, budget, deadline)
        return best

    def _family(self, tiling: list[list[int]], f: int, budget: int, deadline: float):
        plans = self.plans[f]
        count = len(self.families[f].members)
        hull = lower_hull(plans)
        by_cost = sorted(range(len(plans)), key=lambda i: plans[i].cost)
        # 1. Uniform: the cheapest plan that fits in every block, among the hull's plans (to
        # mix with the next on the hull) and among all.
        starts, peaks = [], []
        for pool in ([i for i in by_cost if i in hull], by_cost):
            for index in pool:
                uniform = [list(choice) for choice in tiling]
                uniform[f] = [index] * count
                cost, peak, decision = self.evaluate(uniform)
                peaks.append(peak)
                if peak <= budget:
                    starts.append((cost, peak, decision, uniform))
                    break
        if not starts:
            least = min(peaks)
            raise BudgetError(
                f"tiled: no plan of its block fits when tiled; the least peak it saw is "
                f"{least:,} bytes, above the budget of {budget:,}; try the optimal strategy or "
                "a larger budget", budget=budget, smallest=least)
        # 2. The blocks nearest the loss on a cheaper plan, as many as fit (a bisection on
        # their number): the next on the hull, and the next by cost.
        results = []
        for best in {start[2]: start for start in starts}.values():
            chosen = plans[best[3][f][0]].cost
            cheaper = [i for i in reversed(by_cost) if plans[i].cost < chosen]
            partners = [i for i in cheaper if i in hull][:1] + cheaper[:1]
            for partner in dict.fromkeys(partners):
                few, many = 0, count + 1  # `few` blocks on the partner fit, `many` do not
                while many - few > 1 and time.perf_counter() < deadline:
                    middle = (few + many) // 2
                    top = range(count - middle, count)
                    best, ok = self._try(best, budget, f, {k: partner for k in top})
                    few, many = (middle, many) if ok else (few, middle)
            results.append(best)
        best = min(results, key=lambda r: r[:2])
        # 3. Block by block, the ends first, then down from the loss: the cheapest plan that
        # still fits, while the evaluations last (all blocks of a short stack).
        left = LOCAL_EVALUATIONS
        for k in dict.fromkeys((count - 1, 0, *range(count - 2, 0, -1))):
            current = plans[best[3][f][k]].cost
            for index in by_cost:
                if plans[index].cost >= current or left <= 0 or time.perf_counter() > deadline:
                    break
                left -= 1
                best, ok = self._try(best, budget, f, {k: index})
                if ok:
                    break
        return best

    def _try(self, best, budget: int, f: int, changes: dict[int, int]):
        """`best` with the blocks of family f in `changes` on other plans, if that fits and is
        cheaper; and whether it fits."""
        tiling = [list(choice) for choice in best[3]]
        tiling[f] = [changes.get(k, index) for k, index in enumerate(tiling[f])]
        cost, peak, decision = self.evaluate(tiling)
        if peak > budget:
            return best, False
        if (cost, peak) < best[:2]:
            best = (cost, peak, decision, tiling)
        return best, True
