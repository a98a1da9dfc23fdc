"""The report's rows for the values a plan keeps in host memory: what, how many bytes, where
each is loaded back, its transfers' predicted seconds and what the compute waits for them
(`remat.solvers.timeline.overlap`). Torch-free."""
from __future__ import annotations

from dataclasses import asdict, dataclass

from tabulate import tabulate

from remat.planner.job.budget import format_size
from remat.solvers import Problem

__all__ = ["OffloadRow", "offload_price_row", "offload_rows", "offload_table"]


@dataclass(frozen=True)
class OffloadRow:
    """One value the plan keeps in host memory: its bytes, where it is loaded back, and its
    transfers' predicted seconds (both ways) and the compute's wait for its load."""

    name: str
    module: str
    size: int
    loaded_before: str
    transfer_time: float
    wait: float

    def to_dict(self) -> dict:
        return asdict(self)


def offload_rows(problem: Problem, transfers) -> tuple[OffloadRow, ...]:
    """The offloaded values of a transfer timeline (`remat.solvers.timeline.overlap.Transfers`),
    largest first."""
    ops, bandwidth = problem.ops, problem.host_bandwidth
    return tuple(OffloadRow(name=ops[v].name, module=ops[v].module, size=t.size,
                            loaded_before=_load_point(problem, transfers, t),
                            transfer_time=2 * t.size / bandwidth, wait=t.wait)
                 for v, t in sorted(transfers.by_value.items(),
                                    key=lambda item: (-item[1].size, item[0])))


def _load_point(problem: Problem, transfers, transfer) -> str:
    read = transfer.first_read
    return problem.ops[transfers.steps[read]].name if read is not None else "-"


def offload_table(rows: tuple[OffloadRow, ...]) -> str:
    return tabulate([[r.name, r.module, format_size(r.size), r.loaded_before,
                      f"{r.transfer_time * 1e3:.3g}", f"{r.wait * 1e3:.3g}"] for r in rows],
                    headers=["value", "module", "size", "first read after its load",
                             "transfers ms", "waited ms"], disable_numparse=True)


def offload_price_row(p) -> list[str]:
    """The price table's row of a plan's offloads (`remat.planner.plans.report.Price`)."""
    return ["offloaded to host", format_size(p.offloaded_bytes),
            f"transfers {p.transfer_time * 1e3:.3g} ms both ways on copy streams, "
            f"{p.time_source}: {p.hidden_time * 1e3:.3g} ms hidden under compute, "
            f"{p.exposed_time * 1e3:.3g} ms waited for (in the step time)"]
