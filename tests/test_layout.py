"""The package's layout holds: no import circle between modules, no import from a lower floor to
a higher one (`remat.planner` -> `remat.fx_passes` -> `remat.solvers`), the sub-packages of
`remat.fx_passes` in their order, `remat.solvers` free of torch, and files small enough to read.

Imports are read from the source (every ``import``, at module level or inside a function), so
a circle that only lazy imports made possible is found too."""
from __future__ import annotations

import ast
import functools
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent / "remat"

# A module may import from its own floor or below, never above.
FLOORS = {"remat.errors": 0, "remat.solvers": 1, "remat.fx_passes": 2, "remat.planner": 3}
# Within remat.fx_passes: a sub-package may import from itself or an earlier one.
SUB_PACKAGES = ["tracing", "measuring", "lowering", "compiled", "eager"]
SUB_LEVEL = {"tracing": 0, "measuring": 1, "lowering": 2, "compiled": 3, "eager": 3}
MOST_LINES = 400


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def all_modules() -> dict[str, pathlib.Path]:
    return {module_name(p): p for p in ROOT.rglob("*.py")}


def imports_of(name: str, path: pathlib.Path, modules: dict[str, pathlib.Path]) -> set[str]:
    """The remat modules `name` imports when it runs: for ``from X import Y``, ``X.Y`` when that
    is a module, else ``X``; imports under ``if TYPE_CHECKING:`` are left out."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    tree = ast.parse(path.read_text())
    typing_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If)
                   and ast.unparse(block.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")
                   for n in ast.walk(block)}
    for node in ast.walk(tree):
        if id(node) in typing_only:  # never runs: annotations only
            continue
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("remat"))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            if not base.startswith("remat"):
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in modules else base)
    return {m for m in found if m in modules and m != name}


@functools.cache
def graph() -> dict[str, set[str]]:
    modules = all_modules()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(edges):
        if start not in state and (cycle := visit(start)):
            return cycle
    return None


def floor(name: str) -> int | None:
    for prefix, level in FLOORS.items():
        if name == prefix or name.startswith(prefix + "."):
            return level
    return None


def sub_package(name: str) -> str | None:
    parts = name.split(".")
    return parts[2] if len(parts) > 2 and parts[1] == "fx_passes" else None


def test_the_import_walk_sees_imports_inside_functions():
    edges = graph()
    # eager_plan imports its module-level names; the planner's CLI imports lazily.
    assert "remat.planner.plan" in edges["remat.planner.eager_plan"]
    assert "remat.planner.optimize" not in edges["remat.planner.eager_plan"]
    assert "remat.planner.sweep" in edges["remat.planner.cli"]  # inside main()
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_circle_between_modules():
    assert find_cycle(graph()) is None, f"import circle: {' -> '.join(find_cycle(graph()))}"


def test_no_import_circle_between_sub_packages():
    packages: dict[str, set[str]] = {}
    for name, targets in graph().items():
        mine = sub_package(name)
        if mine is None:
            continue
        packages.setdefault(mine, set()).update(
            t for t in map(sub_package, targets) if t is not None and t != mine)
    assert find_cycle(packages) is None


@pytest.mark.parametrize("name", sorted(all_modules()))
def test_no_import_from_a_lower_floor_to_a_higher_one(name):
    mine = floor(name)
    for target in graph()[name]:
        theirs = floor(target)
        if mine is None or theirs is None:
            continue
        assert theirs <= mine, f"{name} (floor {mine}) imports {target} (floor {theirs})"
        a, b = sub_package(name), sub_package(target)
        if a and b and name.count(".") > 2:  # fx_passes/__init__ re-exports them all
            assert SUB_LEVEL[b] <= SUB_LEVEL[a] and (a == b or SUB_LEVEL[b] < SUB_LEVEL[a]), \
                f"{name} ({a}) imports {target} ({b}): fx_passes' sub-packages are " \
                f"ordered {SUB_PACKAGES}"


def test_solvers_never_import_torch():
    for path in (ROOT / "solvers").rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not any(n == "torch" or n.startswith("torch.") for n in names), path


def test_fx_passes_holds_only_its_sub_packages():
    loose = sorted(p.name for p in (ROOT / "fx_passes").glob("*.py") if p.name != "__init__.py")
    assert loose == []
    found = sorted(p.parent.name for p in (ROOT / "fx_passes").glob("*/__init__.py"))
    assert found == sorted(SUB_PACKAGES)
    for package in SUB_PACKAGES:
        doc = ast.get_docstring(ast.parse((ROOT / "fx_passes" / package / "__init__.py")
                                          .read_text()))
        assert doc, f"remat/fx_passes/{package}/__init__.py says what it owns"


def test_no_file_over_the_size_a_reader_holds():
    long = {str(p.relative_to(ROOT)): n for p in ROOT.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MOST_LINES}
    assert long == {}
