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


def test_readme_links_every_docs_page_and_stays_short():
    """The README is the front door: at most about 300 lines, and every page under docs/ is
    reached from it; every link to a docs page, there or between the pages, names a file that
    exists."""
    root = README.parent
    text = README.read_text()
    assert len(text.splitlines()) <= 320
    linked = set(re.findall(r"\]\((docs/[\w.-]+\.md)(?:#[\w-]*)?\)", text))
    pages = {f"docs/{p.name}" for p in (root / "docs").glob("*.md")}
    assert pages, "no docs pages"
    assert linked - pages == set(), "README links docs pages that do not exist"
    assert pages - linked == set(), "docs pages the README does not link"
    for page in (root / "docs").glob("*.md"):
        for target in re.findall(r"\]\(([\w./-]+\.md)(?:#[\w-]*)?\)", page.read_text()):
            assert (page.parent / target).resolve().is_file(), f"{page.name} links {target}"
