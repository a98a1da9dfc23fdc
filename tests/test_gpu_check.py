"""benchmarks/gpu_check.py runs only where a GPU is lent, rarely: its dry run keeps its code
paths working between those runs. On the CPU its plans part is still a real check (the CPU
allocator within [-2 %, 0] of each plan's simulated peak, a bf16 GPT-2 of two layers)."""
import os
import sys

import pytest

pytest.importorskip("transformers")

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                          "benchmarks")


def test_the_gpu_check_dry_run_plans_within_the_allocator(monkeypatch, capsys):
    monkeypatch.syspath_prepend(BENCHMARKS)
    monkeypatch.delitem(sys.modules, "gpu_check", raising=False)
    import gpu_check

    status = gpu_check.main(["--dry-run", "--checks", "plans", "eager", "--time-limit", "1",
                             "--steps", "1"])
    out = capsys.readouterr().out
    assert "# part plans: passed" in out, out
    assert "# part eager: passed" in out, out
    assert "plans ok, eager ok" in out
    assert status == 0
