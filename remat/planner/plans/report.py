"""What a plan holds and costs, as data first (dataclasses with `to_dict()`), rendered with
tabulate only when printed. Torch-free.

Four parts: (1) the memory of the step by term, for the plan and the baselines beside it; (2) the
plan per module, collapsed to repeated blocks, and the largest tensors it keeps; (3) the price:
recompute FLOPs and time, the step time on the target device, MFU and HFU; (4) the solver
(`remat.planner.plans.solver_report`: its limits, the planning call's phases, the gap).
"""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field

from tabulate import tabulate

from remat.planner.job.accounting import StepMemory
from remat.planner.job.budget import format_size
from remat.planner.plans.offload_report import OffloadRow, offload_price_row, offload_table
from remat.planner.plans.solver_report import SolverSummary, solver_table
from remat.solvers import Problem, Schedule
from remat.solvers.baselines.standard import block_of


@dataclass(frozen=True)
class MemoryColumn:
    """One schedule's step memory, or why there is none (the baseline failed to run)."""

    name: str
    memory: StepMemory | None
    note: str = ""

    def to_dict(self) -> dict:
        return {"name": self.name, "note": self.note,
                "memory": self.memory.to_dict() if self.memory else None}


@dataclass(frozen=True)
class ModuleRow:
    """The plan inside one block (or a run of identical blocks, `count` of them; the numbers
    are per block)."""

    module: str
    count: int
    ops_recomputed: int
    bytes_recomputed: int
    """Bytes of forward values that the plan frees after the forward instead of keeping for the
    backward: the memory the recomputation avoids ("saved" would mean kept for the backward,
    as PyTorch says it)."""
    bytes_kept: int
    """Bytes of forward values the plan keeps for the backward."""
    recompute_flops: int

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class KeptTensor:
    name: str
    module: str
    target: str
    size: int

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Price:
    """What the recomputation costs. Times, and MFU/HFU from them, are `time_source`
    ("predicted" by the cost model for `device`, or "measured")."""

    model_flops: int
    recompute_flops: int
    step_time: float
    """Seconds of one step with the plan: the model's ops plus the recomputations."""
    recompute_time: float
    device: str
    peak_flops: float | None
    time_source: str
    offloaded_bytes: int = 0
    """Bytes the plan keeps in host memory between the forward and the backward."""
    transfer_time: float = 0.0
    """Predicted seconds of those bytes over the host link, both ways, on copy streams beside
    the compute."""
    recomputations: int = 0
    """Forward ops run again, every copy counted (in the forward too, or twice)."""
    exposed_time: float = 0.0
    """Of `transfer_time`, the predicted seconds the compute waits for (in `step_time`); the
    rest is hidden under the compute (`remat.solvers.timeline.overlap`)."""

    @property
    def hidden_time(self) -> float:
        return max(0.0, self.transfer_time - self.exposed_time)

    @property
    def recompute_pct(self) -> float:
        return 100.0 * self.recompute_flops / self.model_flops if self.model_flops else 0.0

    @property
    def mfu(self) -> float | None:
        """Model FLOPs over the step time times the device's peak FLOP/s."""
        if not self.peak_flops or self.step_time <= 0:
            return None
        return self.model_flops / (self.step_time * self.peak_flops)

    @property
    def hfu(self) -> float | None:
        """As MFU, counting the recomputed FLOPs too."""
        if not self.peak_flops or self.step_time <= 0:
            return None
        return (self.model_flops + self.recompute_flops) / (self.step_time * self.peak_flops)

    def to_dict(self) -> dict:
        return {**asdict(self), "recompute_pct": self.recompute_pct, "mfu": self.mfu,
                "hfu": self.hfu, "hidden_time": self.hidden_time}


@dataclass(frozen=True)
class Measured:
    """Numbers measured by running the planned step, to set beside the prediction."""

    peak: int
    """Measured peak live bytes of the step's graph values (the scope of the simulated peak:
    activations and the gradients the graph makes)."""
    source: str
    step_time: float | None = None

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Report:
    title: str
    memory: tuple[MemoryColumn, ...]
    modules: tuple[ModuleRow, ...]
    kept: tuple[KeptTensor, ...]
    price: Price
    solver: SolverSummary
    measured: Measured | None = None
    notes: tuple[str, ...] = field(default_factory=tuple)
    offloaded: tuple[OffloadRow, ...] = ()

    @property
    def plan_memory(self) -> StepMemory:
        return self.memory[0].memory

    def to_dict(self) -> dict:
        return {"title": self.title, "memory": [c.to_dict() for c in self.memory],
                "modules": [m.to_dict() for m in self.modules],
                "kept": [k.to_dict() for k in self.kept], "price": self.price.to_dict(),
                "solver": self.solver.to_dict(),
                "measured": self.measured.to_dict() if self.measured else None,
                "notes": list(self.notes), "offloaded": [o.to_dict() for o in self.offloaded]}

    def render(self) -> str:
        parts = [self.title, "", "Memory of one step (per rank)", _memory_table(self.memory), "",
                 "The plan per module (numbers per block)", _module_table(self.modules), "",
                 "Largest tensors kept for the backward", _kept_table(self.kept), "",
                 *(["Offloaded to host", offload_table(self.offloaded), ""]
                   if self.offloaded else []),
                 "The price", _price_table(self.price), "", "The solver",
                 solver_table(self.solver)]
        if self.measured is not None:
            parts += ["", "Predicted vs measured", _measured_table(self.plan_memory,
                                                                   self.measured)]
        if self.notes:
            parts += [""] + [f"note: {n}" for n in self.notes]
        return "\n".join(parts)

    __str__ = render


# ----------------------------------------------------------------------------- building


def module_rows(problem: Problem, schedule: Schedule) -> tuple[ModuleRow, ...]:
    """Per block ("h.3"), or per top-level module outside blocks, then runs of consecutive
    blocks with identical numbers merged into one row ("h.0-11", count 12)."""
    groups: dict[str, list[int]] = {}
    for v in problem.candidates:
        groups.setdefault(_group(problem.ops[v].module), []).append(v)
    rows = []
    for name, values in groups.items():
        recomputed = [v for v in values if v in schedule.recomputed]
        rows.append(ModuleRow(
            module=name, count=1, ops_recomputed=len(recomputed),
            bytes_recomputed=sum(problem.ops[v].size for v in recomputed),
            bytes_kept=sum(problem.ops[v].size for v in values if v in schedule.saved),
            recompute_flops=sum(problem.ops[v].flops for v in recomputed)))
    return tuple(_merge_runs(rows))


def _group(module: str) -> str:
    block = block_of(module)
    if block is not None:
        return block
    return module.split(".")[0] if module else "(top level)"


_INDEXED = re.compile(r"^(.*?)(\d+)$")


def _merge_runs(rows: list[ModuleRow]) -> list[ModuleRow]:
    merged: list[ModuleRow] = []
    last_index: int | None = None
    for row in rows:
        match = _INDEXED.match(row.module)
        prev = merged[-1] if merged else None
        if (match and prev is not None and last_index is not None
                and prev.module.startswith(match[1]) and int(match[2]) == last_index + 1
                and _numbers(prev) == _numbers(row)):
            first = prev.module[len(match[1]):].split("-")[0]
            merged[-1] = ModuleRow(module=f"{match[1]}{first}-{match[2]}", count=prev.count + 1,
                                   ops_recomputed=row.ops_recomputed,
                                   bytes_recomputed=row.bytes_recomputed,
                                   bytes_kept=row.bytes_kept, recompute_flops=row.recompute_flops)
        else:
            merged.append(row)
        last_index = int(match[2]) if match else None
    return merged


def _numbers(row: ModuleRow) -> tuple:
    return row.ops_recomputed, row.bytes_recomputed, row.bytes_kept, row.recompute_flops


def kept_tensors(problem: Problem, schedule: Schedule, top: int = 5) -> tuple[KeptTensor, ...]:
    largest = sorted(schedule.saved, key=lambda v: (-problem.ops[v].size, v))[:top]
    return tuple(KeptTensor(name=problem.ops[v].name, module=problem.ops[v].module,
                            target=problem.ops[v].target, size=problem.ops[v].size)
                 for v in largest)


def _fused_away(problem: Problem) -> float:
    """Seconds of the forward ops a compiled plan's problem costs at nothing because their
    recomputations are fused away (``source["free_recompute"]``): the forward still runs them."""
    return sum((problem.source.get("free_recompute") or {}).values())


def price(problem: Problem, schedule: Schedule, *, device: str, peak_flops: float | None,
          time_source: str) -> Price:
    exposed = schedule.exposed_time
    return Price(model_flops=problem.total_flops, recompute_flops=schedule.recompute_flops,
                 step_time=problem.total_cost + schedule.cost + _fused_away(problem),
                 recompute_time=schedule.cost - exposed, device=device, peak_flops=peak_flops,
                 time_source=time_source,
                 offloaded_bytes=sum(problem.ops[v].size for v in schedule.offload_at),
                 transfer_time=schedule.transfer_time, exposed_time=exposed,
                 recomputations=schedule.recomputations if schedule.again else 0)


# ----------------------------------------------------------------------------- rendering


def _memory_table(columns: tuple[MemoryColumn, ...]) -> str:
    present = [c for c in columns if c.memory is not None]
    if not present:
        return "(no schedule)"
    terms = [(name, counted, note) for name, _, counted, note in present[0].memory.rows()]
    table = []
    for k, (name, counted, note) in enumerate(terms):
        values = [format_size(c.memory.rows()[k][1]) if c.memory else "" for c in columns]
        table.append([name + ("" if counted else " *"), *values])
    table.append(["total", *[format_size(c.memory.total) if c.memory else c.note
                             for c in columns]])
    budget = present[0].memory.budget
    if budget is not None:
        table.append(["budget", *[format_size(budget)] * len(columns)])
        table.append(["fits", *[("yes" if c.memory.fits else "no") if c.memory else ""
                                for c in columns]])
    text = tabulate(table, headers=["term", *[c.name for c in columns]], disable_numparse=True,
                    colalign=("left", *["right"] * len(columns)))
    for name, counted, note in terms:
        if not counted:
            text += f"\n* {name}: {note}"
        elif name in ("gradients", "activation peak") or (
                name == "parameters" and not present[0].memory.state.weights):
            text += f"\n  {name}: {note}"
    return text


def _module_table(rows: tuple[ModuleRow, ...]) -> str:
    table = [[r.module, r.count, r.ops_recomputed, format_size(r.bytes_recomputed),
              format_size(r.bytes_kept), _flops(r.recompute_flops)] for r in rows]
    return tabulate(table, headers=["module", "blocks", "ops recomputed", "memory avoided",
                                    "kept for backward", "recompute FLOPs"],
                    disable_numparse=True)


def _kept_table(kept: tuple[KeptTensor, ...]) -> str:
    if not kept:
        return "(nothing is kept)"
    return tabulate([[k.name, k.module, k.target, format_size(k.size)] for k in kept],
                    headers=["value", "module", "op", "size"], disable_numparse=True)


def _price_table(p: Price) -> str:
    pct = lambda x: "n/a" if x is None else f"{100 * x:.1f} %"  # noqa: E731
    rows = [
        ["model FLOPs", _flops(p.model_flops), "counted"],
        ["recompute FLOPs", f"{_flops(p.recompute_flops)} ({p.recompute_pct:.2f} % of model)",
         "counted"],
        ["step time", f"{p.step_time * 1e3:.3f} ms", f"{p.time_source} ({p.device})"],
        ["recompute time", f"{p.recompute_time * 1e3:.3f} ms", f"{p.time_source} ({p.device})"],
    ]
    if p.recomputations:
        rows.append(["recomputations", f"{p.recomputations} op runs",
                     "forward ops run again (within the forward, and second ones, counted)"])
    if p.offloaded_bytes:
        rows.append(offload_price_row(p))
    rows += [
        [f"MFU, {p.time_source}", pct(p.mfu),
         f"counted model FLOPs over the {p.time_source} step time on {p.device}"],
        [f"HFU, {p.time_source}", pct(p.hfu), "as MFU, with the recomputed FLOPs"],
    ]
    return tabulate(rows, headers=["", "value", "source"], disable_numparse=True)


def _measured_table(memory: StepMemory, measured: Measured) -> str:
    # A tracker of the step's graph sees its values, the gradients it makes included: the
    # simulated peak, not the activations alone.
    predicted = memory.simulated_peak
    error = (measured.peak - predicted) / max(predicted, 1)
    rows = [["graph's live bytes (activations and its gradients)", format_size(predicted),
             format_size(measured.peak), f"{100 * error:+.2f} %", measured.source]]
    return tabulate(rows, headers=["", "predicted", "measured", "error", "measured by"],
                    disable_numparse=True)


def _flops(n: int | float) -> str:
    for unit, scale in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} FLOP"
