"""The import graph of the packages has no cycles and points down the layers, with no exception.

Read from the source (AST), so every import counts: module level, inside functions, and the type-only
ones under ``if TYPE_CHECKING:`` (a cycle hidden there still couples the two modules). ``from pkg import
name`` points at the submodule ``pkg.name`` when there is one, else at the package ``pkg``; a package's
``__init__`` running first is Python's, not an edge (else every package with submodules would be a cycle).

The layers, top to bottom (README, "Layout"; ``docs/design.md``):

* ``vfl`` - the command line, the estimators, the plots of a run folder: what a user calls;
* ``parties`` - processes: one MPI rank per party, launch, checkpoints, the horizontal ranks;
* ``vertical`` (the vertical learning core), ``horizontal`` (the horizontal core) and ``protocols`` (the
  wire): none of them imports another; compressors reach ``horizontal`` by injection.

A package imports only the layers below its own. ``experiments`` stands above all of them.

One more source-hygiene check lives here: comments and docstrings point only inside the repository.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: top to bottom; the packages of one layer import none of each other
LAYERS = (("vfl",), ("parties",), ("vertical", "horizontal", "protocols"))
PACKAGES = tuple(package for layer in LAYERS for package in layer)
LAYER_OF = {package: depth for depth, layer in enumerate(LAYERS) for package in layer}
SCANNED = (*PACKAGES, "experiments", "tests")
SPEC_POINTER = re.compile(r"spec ?§|-spec\b|spec\.md|trap T\d+|(?<![A-Za-z])§\d")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module → the modules of these packages that it imports, anywhere in its source."""
    graph = {}
    for name, path in modules.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                targets |= {a.name for a in node.names if a.name in modules}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join([*package[: len(package) - node.level + 1], *filter(None, [base])])
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    targets.add(sub if sub in modules else base)
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles() -> None:
    assert cycles(import_graph(_modules())) == []


def points_down(source: str, target: str) -> bool:
    """Whether ``source`` may import ``target``: its own package, or any package of a lower layer."""
    mine, theirs = source.split(".")[0], target.split(".")[0]
    return mine == theirs or LAYER_OF[theirs] > LAYER_OF[mine]


def test_imports_point_down_the_layers() -> None:
    wrong = [f"{source} imports {target}" for source, targets in import_graph(_modules()).items()
             for target in sorted(targets) if not points_down(source, target)]
    assert wrong == []


def test_the_layer_rule_refuses_up_and_sideways_imports() -> None:
    """The rule itself: down is allowed; up, and sideways within the bottom layer, are not."""
    assert points_down("vfl.cli", "parties.launch") and points_down("parties.training", "vertical.problems")
    assert points_down("vertical.kernels", "vertical.problems")
    assert not points_down("parties.training", "vfl.cli")
    assert not points_down("vertical.problems", "protocols.masking")
    assert not points_down("protocols.compression.base", "horizontal.base")


@pytest.mark.parametrize("type_only", [False, True])
def test_the_checker_sees_a_cycle_even_behind_type_checking(tmp_path: Path, type_only: bool) -> None:
    """The detector itself: two modules that import each other (one of them only for typing) are found."""
    (tmp_path / "a.py").write_text("from b import B\n")
    guard = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    " if type_only else ""
    (tmp_path / "b.py").write_text(f"{guard}from a import A\n")
    (tmp_path / "c.py").write_text("import a\n")
    modules = {p.stem: p for p in sorted(tmp_path.glob("*.py"))}
    graph = import_graph(modules)
    assert graph == {"a": {"b"}, "b": {"a"}, "c": {"a"}}
    assert cycles(graph) == [["a", "b"]]


def test_comments_point_only_inside_the_repository() -> None:
    """Comments and docstrings cite the public papers or files of this repository, never the sections or
    trap numbers of implementation notes kept outside it: they state the point or quote the line."""
    this = Path(__file__).resolve()
    results = ROOT / "experiments" / "results"
    hits = []
    for package in SCANNED:
        for path in sorted((ROOT / package).rglob("*.py")):
            if results in path.parents:
                continue
            for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
                if path == this and line.startswith("SPEC_POINTER = "):
                    continue  # the pattern itself
                if SPEC_POINTER.search(line):
                    hits.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert hits == [], "pointers outside the repository:\n" + "\n".join(hits)
