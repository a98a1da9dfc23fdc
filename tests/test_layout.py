"""The package's layout holds: no import circle between modules, no import from a lower floor to
a higher one (`remat.planner` -> `remat.fx_passes` -> `remat.solvers`), the sub-packages of
`remat.fx_passes`, `remat.solvers` and `remat.planner` in their order, each package holding
only its sub-packages (and its entries), `remat.solvers` free of torch, the torch-free tests
free of it too, `docs/layout.md` naming every module, and files small enough to read.

Imports are read from the source (every ``import``, at module level, inside a function or
under ``if TYPE_CHECKING:``), so a circle that only lazy imports or annotations made possible
is found too."""
from __future__ import annotations

import ast
import functools
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent / "remat"

# A module may import from its own floor or below, never above.
FLOORS = {"remat.errors": 0, "remat.solvers": 1, "remat.fx_passes": 2, "remat.planner": 3}
# Within each package: a sub-package may import from itself or an earlier floor; two on one
# floor never import each other; the package's own modules (its entries) sit above them all.
SUB_LEVELS = {
    "fx_passes": {"tracing": 0, "measuring": 1, "lowering": 2, "compiled": 3, "eager": 3},
    "solvers": {"core": 0, "timeline": 1, "baselines": 2, "relaxation": 3, "cpsat": 4,
                "eager": 5},
    "planner": {"job": 0, "plans": 1, "parallel": 2},
}
# The modules a package holds beside its sub-packages: the calls a user makes, the entries.
ENTRIES = {
    "fx_passes": set(),
    "solvers": {"entry"},
    "planner": {"optimize", "sweep", "load_plan", "broadcast", "hf", "cli", "demo"},
}
MOST_LINES = 400
TESTS = ROOT.parent / "tests"


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def all_modules() -> dict[str, pathlib.Path]:
    return {module_name(p): p for p in ROOT.rglob("*.py")}


def imports_of(name: str, path: pathlib.Path, modules: dict[str, pathlib.Path]) -> set[str]:
    """The remat modules `name` imports: for ``from X import Y``, ``X.Y`` when that is a
    module, else ``X``. Imports under ``if TYPE_CHECKING:`` count: a circle of types is a
    circle a reader follows, and one a runtime import closes the day it is needed."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
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


def sub_package(name: str) -> tuple[str, str] | None:
    """(package, sub-package) of a module inside one of `SUB_LEVELS`' sub-packages; None for
    a package's face and its entries."""
    parts = name.split(".")
    if len(parts) > 2 and parts[1] in SUB_LEVELS and parts[2] in SUB_LEVELS[parts[1]]:
        return parts[1], parts[2]
    return None


def entry(name: str) -> str | None:
    """The package of a module that is one of its entries (`ENTRIES`)."""
    parts = name.split(".")
    if len(parts) == 3 and parts[1] in ENTRIES and parts[2] in ENTRIES[parts[1]]:
        return parts[1]
    return None


def test_the_import_walk_sees_imports_inside_functions_and_for_types():
    edges = graph()
    # eager_plan imports its module-level names; the planner's CLI imports lazily.
    assert "remat.planner.plans.plan" in edges["remat.planner.plans.eager_plan"]
    assert "remat.planner.optimize" not in edges["remat.planner.plans.eager_plan"]
    assert "remat.planner.sweep" in edges["remat.planner.cli"]  # inside main()
    source = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from remat.errors import X\n"
    path = TESTS / "_typing_probe.py"
    try:
        path.write_text(source)
        assert imports_of("remat.probe", path, all_modules()) == {"remat.errors"}
    finally:
        path.unlink()
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_circle_between_modules():
    assert find_cycle(graph()) is None, f"import circle: {' -> '.join(find_cycle(graph()))}"


def test_no_import_circle_between_sub_packages():
    packages: dict[tuple[str, str], set[tuple[str, str]]] = {}
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
        if b and entry(target) is None and (a is None and entry(name) is None):
            continue  # a package's face re-exports what it likes
        if a and b and a[0] == b[0]:
            levels = SUB_LEVELS[a[0]]
            assert a == b or levels[b[1]] < levels[a[1]], \
                f"{name} ({a[1]}) imports {target} ({b[1]}): {a[0]}'s sub-packages are " \
                f"ordered {levels}"
        if a and entry(target) == a[0]:
            raise AssertionError(f"{name} imports {target}, an entry above its sub-packages")
        if a and target == f"remat.{a[0]}":
            raise AssertionError(f"{name} imports its package's face remat.{a[0]}: import "
                                 "the module that defines the name")


def test_solvers_never_import_torch():
    for path in (ROOT / "solvers").rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not any(n == "torch" or n.startswith("torch.") for n in names), path


@pytest.mark.parametrize("package", sorted(SUB_LEVELS))
def test_a_package_holds_only_its_sub_packages_and_entries(package):
    loose = {p.stem for p in (ROOT / package).glob("*.py") if p.name != "__init__.py"}
    assert loose == ENTRIES[package]
    found = sorted(p.parent.name for p in (ROOT / package).glob("*/__init__.py"))
    assert found == sorted(SUB_LEVELS[package])
    for sub in found:
        doc = ast.get_docstring(ast.parse((ROOT / package / sub / "__init__.py").read_text()))
        assert doc, f"remat/{package}/{sub}/__init__.py says what it owns"


def test_docs_layout_names_every_module():
    """Each package of remat has a line in docs/layout.md that starts with its path
    (`remat/solvers/core/`), and each of its modules is named in the lines up to the next
    such line."""
    import re

    lines = (ROOT.parent / "docs" / "layout.md").read_text().splitlines()
    sections: dict[str, str] = {}
    current = None
    for line in lines:
        head = line.split()[0] if line.strip() else ""
        if head.startswith("remat") and head.endswith("/"):
            current = head
        if current is not None:
            sections[current] = sections.get(current, "") + line + "\n"
    missing = []
    for path in sorted(ROOT.rglob("*.py")):
        if path.name == "__init__.py":
            continue
        package = str(path.parent.relative_to(ROOT.parent)) + "/"
        if not re.search(rf"\b{path.stem}\b", sections.get(package, "")):
            missing.append(str(path.relative_to(ROOT.parent)))
    assert missing == [], "docs/layout.md does not name these modules"


def test_the_solver_tests_never_import_torch():
    """`python -m pytest tests/solvers` runs where torch is not installed: no test there, and
    no helper of tests/ that one imports, imports torch (or anything that does)."""
    heavy = {"torch", "transformers", "peft", "examples"}
    torch_modules = {m for m in graph() if floor(m) is not None and floor(m) >= 2}
    seen: set[pathlib.Path] = set()
    todo = list((TESTS / "solvers").rglob("*.py")) + [TESTS / "conftest.py"]
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        tree = ast.parse(path.read_text())
        # conftest imports torch only under xdist, which CI runs with torch installed
        xdist_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If)
                      and "PYTEST_XDIST_WORKER" in ast.unparse(block.test)
                      for n in ast.walk(block)}
        for node in ast.walk(tree):
            if id(node) in xdist_only:
                continue
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            for n in names:
                assert n.split(".")[0] not in heavy, f"{path.relative_to(TESTS)} imports {n}"
                assert not any(n == m or n.startswith(m + ".") for m in torch_modules), \
                    f"{path.relative_to(TESTS)} imports {n}, which imports torch"
                if n.startswith("tests."):
                    module = TESTS.parent / (n.replace(".", "/") + ".py")
                    package = TESTS.parent / n.replace(".", "/") / "__init__.py"
                    todo += [p for p in (module, package) if p.exists()]


def test_no_file_over_the_size_a_reader_holds():
    long = {str(p.relative_to(ROOT)): n for p in ROOT.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MOST_LINES}
    assert long == {}
