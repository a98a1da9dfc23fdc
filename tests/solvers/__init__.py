"""The torch-free solver core's tests: `python -m pytest tests/solvers` runs without torch."""
