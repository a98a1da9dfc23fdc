"""The rich model's offloads in CP-SAT: a sound linearisation of `remat.solvers.timeline.overlap`.

The exact timeline (compute waits, FIFO copy streams, recomputations' durations) is not linear
in the model's decisions; this part charges an upper bound of what the step waits for, and
holds each offloaded device copy at least as long as it really lives, so that every schedule
the model accepts fits and costs at most what the model says. The driver then prices the
schedule it reads off exactly (`schedule.evaluate`).

The model's timeline is the *reduced* one: every op at its place, recomputations taking no
time (`times[i]`: the start of op i, costs summed). Per offloadable value u (a load `at_u`
exists in RichModel):
- its copy to host is an optional interval of its transfer's length on the device-to-host
  stream, starting no earlier than the end of u's last forward reader; the stream runs them in
  that order (FIFO, as `overlap.offload_points` issues them);
- `rel_u`, a forward op after that reader: the copy has ended by the op's start, and the
  device copy is held up to the steps placed before the op, which start then too; or the
  forward's end (`rel_u` = nf), where the compute waits for every copy to host
  (`overlap`'s join): `late_end` >= each copy's end less the forward's, a cost;
- its load is an optional interval on the host-to-device stream starting no earlier than
  `times[at_u]` and than the copy to host's end, in the order of the loads' positions (ties by
  value, as `simulate.step_order`);
- `late_u` >= the load's end less the start of every read it serves: the cost charged.
Why this bounds the truth: what the step waits for never grows when an op takes longer (a
longest-path argument: overlap.py's exposed time is the most, over chains, of transfer time
less the compute off the chain), so the reduced timeline waits at least as long as the real
one; in it, each wait is at most the lateness of its load in the timeline without waits, whose
as-early-as-possible FIFO transfers end no later than the model's intervals; and the real copy
to host ends no later than `times[rel_u]` shifted by the compute and waits before u's reader,
which shift `rel_u`'s start at least as much. Times round in the safe direction (issues and
lengths up, starts of reads and releases down).

Where the model does not follow the exact timeline, it restricts itself: an offloaded value has
no further copy, and no reader of it runs again within the forward (its copy to host then
leaves after its last forward reader op); its device copy is released before a forward op whose
reduced start follows its copy's end, or at the forward's end (the real timeline may release it
sooner, where the compute waits for a load). The exhaustive search (`tests.oracles.rich_brute`)
spans those schedules too.
"""
from __future__ import annotations

import math

from remat.solvers.core.problem import Problem

# Beyond this many offloadable values the pairwise FIFO orders (quadratic) are not built, and
# the model does not offload (`remat.solvers.cpsat.offload_search` offloads at that scale).
MAX_LOADS = 60


class Transfers:
    """Adds the transfers of `model`'s loads (RichModel) to its CP-SAT model: `late` (one cost
    variable per load, in cost units) and `host` (bytes offloaded)."""

    def __init__(self, model, reads: dict[int, list]):
        self.model = model
        problem: Problem = model.problem
        ops, unit, bandwidth = problem.ops, model.units.cost, problem.host_bandwidth
        starts = [0.0]
        for op in ops:
            starts.append(starts[-1] + op.cost)
        self.down = [math.floor(t / unit) for t in starts]  # starts of reads, releases
        self.up = [math.ceil(t / unit) for t in starts]  # issues
        self._horizon = self.up[-1] + sum(math.ceil(2 * ops[u].size / bandwidth / unit) + 2
                                          for u in model.load)
        self.late: dict[int, object] = {}
        self.release: dict[int, object] = {}
        self.late_end = model.model.NewIntVar(0, self._horizon, "late_end_of_forward")
        self._outs, self._ins = [], []  # the intervals on each copy stream
        self._out_span, self._in_span = {}, {}  # u: (start, end) of each transfer
        order = sorted(model.load, key=lambda u: (_last_forward_read(problem, u), u))
        for u in order:
            off = model.load[u].active
            length = math.ceil(ops[u].size / bandwidth / unit)
            last = _last_forward_read(problem, u)
            s_out = self._copy_to_host(u, off, length, last)
            self._device_release(u, off, length, last, s_out)
            s_in = self._load_back(u, off, length, s_out)
            self._lateness(u, length, s_in, reads[u])
            self._restrict(u, off)
        self._fifo(order)
        self._host_capacity()

    def _copy_to_host(self, u: int, off, length: int, last: int):
        """The copy to host, after the last forward reader; its start."""
        m = self.model.model
        s_out = m.NewIntVar(0, self._horizon, f"out_start{u}")
        self._outs.append(m.NewOptionalFixedSizeIntervalVar(s_out, length, off, f"out{u}"))
        m.Add(s_out >= self.up[last + 1]).OnlyEnforceIf(off)
        self._out_span[u] = s_out, s_out + length
        return s_out

    def _device_release(self, u: int, off, length: int, last: int, s_out) -> None:
        """u's device copy, released before op rel: the copy to host has ended by its start."""
        model = self.model
        m, nf = model.model, model.problem.num_forward
        rel = m.NewIntVar(last + 1, nf, f"release{u}")  # nf: at the forward's end
        m.Add(rel == last + 1).OnlyEnforceIf(off.Not())
        at_rel = m.NewIntVar(0, self.down[-1], f"release_time{u}")
        m.AddElement(rel, self.down, at_rel)
        within = m.NewBoolVar(f"released{u}")
        m.Add(rel <= nf - 1).OnlyEnforceIf(within)
        m.Add(rel == nf).OnlyEnforceIf(within.Not())
        m.Add(s_out + length <= at_rel).OnlyEnforceIf([off, within])
        # The backward begins once every copy to host has ended (overlap's join).
        m.Add(self.late_end >= s_out + length - self.down[nf]).OnlyEnforceIf(off)
        # Every step of op rel's block (its loads, its recomputations, the op) starts
        # after the copy ended; the device copy is held through the block before.
        original = model.storages[u][0]
        m.Add(original.end >= rel * model.width - 1).OnlyEnforceIf(off)
        self.release[u] = rel

    def _load_back(self, u: int, off, length: int, s_out):
        """The load back, after its issue and after the copy to host; its start."""
        m = self.model.model
        s_in = m.NewIntVar(0, self._horizon, f"in_start{u}")
        self._ins.append(m.NewOptionalFixedSizeIntervalVar(s_in, length, off, f"in{u}"))
        issued = m.NewIntVar(0, self.up[-1], f"in_issue{u}")
        m.AddElement(self.model.load[u].pos, self.up, issued)
        m.Add(s_in >= issued).OnlyEnforceIf(off)
        m.Add(s_in >= s_out + length).OnlyEnforceIf(off)
        self._in_span[u] = s_in, s_in + length
        return s_in

    def _lateness(self, u: int, length: int, s_in, reads: list) -> None:
        """What the step may wait for the load: after every read the load serves."""
        model = self.model
        m = model.model
        late = self.late[u] = m.NewIntVar(0, self._horizon, f"late{u}")
        k = len(model.storages[u]) - 1  # the load is the storage's last copy
        for i, read in enumerate(reads):
            x = model.x.get((u, i, k))
            if x is None:
                continue
            m.Add(late >= s_in + length - self._start(read.pos)).OnlyEnforceIf(x)

    def _fifo(self, order: list[int]) -> None:
        """FIFO on each copy stream: copies to host in `order` (by last forward reader),
        loads in the order of their positions; neither stream runs two at once."""
        model = self.model
        m, load = model.model, model.load
        for a, x in enumerate(order):
            for y in order[a + 1:]:
                both = [load[x].active, load[y].active]
                m.Add(self._out_span[x][1] <= self._out_span[y][0]).OnlyEnforceIf(both)
        by_value = sorted(load)
        for a, x in enumerate(by_value):
            for y in by_value[a + 1:]:
                first = m.NewBoolVar(f"in_before{x}_{y}")  # x's load is issued first
                m.Add(load[x].pos <= load[y].pos).OnlyEnforceIf(first)
                m.Add(load[x].pos > load[y].pos).OnlyEnforceIf(first.Not())
                both = [load[x].active, load[y].active]
                m.Add(self._in_span[x][1] <= self._in_span[y][0]).OnlyEnforceIf([first, *both])
                m.Add(self._in_span[y][1] <= self._in_span[x][0]).OnlyEnforceIf(
                    [first.Not(), *both])
        m.AddNoOverlap(self._outs)
        m.AddNoOverlap(self._ins)

    def _host_capacity(self) -> None:
        """The host holds what is offloaded."""
        model, problem = self.model, self.model.problem
        if problem.host_capacity is not None:
            model.model.Add(sum(problem.ops[u].size * model.load[u].active for u in model.load)
                            <= problem.host_capacity)

    def _start(self, pos):
        """The reduced start of the op at `pos` (an op index, or a position variable)."""
        if isinstance(pos, int):
            return self.down[pos]
        m = self.model.model
        at = m.NewIntVar(0, self.down[-1], f"read_time_{pos.Name()}")
        m.AddElement(pos, self.down, at)
        return at

    def _restrict(self, u: int, off) -> None:
        """An offloaded value has no further copy, and none of its readers runs again within
        the forward (module docstring)."""
        model = self.model
        m, problem = model.model, model.problem
        for c in model.further.get(u, ()):
            m.AddImplication(off, c.active.Not())
        for r, copies in model.further.items():
            if u in problem.storage_inputs[r]:
                for c in copies:
                    m.AddBoolOr([c.active.Not(), c.backward]).OnlyEnforceIf(off)

    def terms(self) -> list:
        return [*self.late.values(), self.late_end]


def _last_forward_read(problem: Problem, u: int) -> int:
    nf = problem.num_forward
    return max((r for r in problem.storage_readers[u] if r < nf), default=u)
