"""benchmarks/gpu_check.py runs only where a GPU is lent, rarely: its dry run keeps its code
paths working between those runs. On the CPU its plans part is still a real check (the CPU
allocator within [-2 %, 0] of each plan's simulated peak, a bf16 GPT-2 of two layers)."""
import os
import subprocess
import sys

import pytest

pytest.importorskip("transformers")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_gpu_check_dry_run_plans_within_the_allocator():
    done = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "gpu_check.py"), "--dry-run",
         "--checks", "plans", "eager", "--time-limit", "2"],
        capture_output=True, text=True, timeout=600, cwd=ROOT)
    out = done.stdout
    assert "# part plans: passed" in out, out + done.stderr
    assert "# part eager: passed" in out, out + done.stderr
    assert "plans ok, eager ok" in out
    assert done.returncode == 0
