import os
import sys

# Benchmarks and examples import the test models by package path.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hypothesis import settings  # noqa: E402

# The suite draws the same examples on every run, so that a CI run cannot turn red on a
# structure drawn for the first time; `HYPOTHESIS_PROFILE=explore python -m pytest ...`
# draws new ones each run, as a search for bugs (the exact eager model's property tests found
# a real mismatch that way).
settings.register_profile("suite", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "suite"))

# Under pytest-xdist each worker takes one core's share: torch's intra-op threads default to
# every core, and with two workers on two cores (and CI's neighbours) their spinning threads
# oversubscribe the machine.
if os.environ.get("PYTEST_XDIST_WORKER"):
    try:
        import torch  # noqa: E402
    except ImportError:  # tests/solvers runs without torch
        pass
    else:
        torch.set_num_threads(1)
