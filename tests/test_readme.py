"""The README's Hugging Face example runs as written (its code is the README's, not a copy)."""
from __future__ import annotations

import pathlib
import re

import pytest

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def _code_after(heading: str) -> str:
    text = README.read_text()
    start = text.index(heading)
    return re.search(r"```python\n(.*?)```", text[start:], re.S).group(1)


@pytest.mark.slow
def test_hugging_face_example_trains_with_an_eager_plan():
    pytest.importorskip("transformers")
    scope: dict = {}
    exec(compile(_code_after("### A Hugging Face model in a plain loop"), "README.md", "exec"),
         scope)
    plan, model = scope["plan"], scope["model"]
    assert plan.recompute_flops > 0  # the budget made it recompute: the policy really ran
    assert plan.activation_peak <= 8_000_000
    assert all(p.grad is None for p in model.parameters())  # zero_grad ran after the steps
    assert scope["loss"].isfinite()
