"""Busy processes beside a benchmark (`--load N`): pure-Python spin loops, killed at the end."""
from __future__ import annotations

import contextlib
import subprocess
import sys


@contextlib.contextmanager
def busy(processes: int):
    """`processes` spin loops running until the block ends."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                for _ in range(processes)]
    try:
        yield
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()
