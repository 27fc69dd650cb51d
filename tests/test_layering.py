"""The layering rules of docs/design.md, asserted over every import in plait/ (the "nevers").

Layers from the bottom; a module may import from its own layer or below. Imports under ``if TYPE_CHECKING:``
are type annotations, not dependencies, and are not checked. Function-level (lazy) imports are checked like
the rest: they run too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PLAIT = Path(__file__).resolve().parent.parent / "plait"

LAYERS: list[tuple[str, ...]] = [
    ("plait.errors", "plait.logging", "plait.files", "plait.threads", "plait.hf_folders"),
    ("plait.layout",),
    ("plait.mesh", "plait.distributed", "plait.determinism", "plait.launch", "plait.rendezvous"),
    ("plait.comm",),
    ("plait.observe",),
    ("plait.models", "plait.data"),
    ("plait.parallel",),
    ("plait.planner",),
    ("plait.checkpoint",),
    ("plait.parallelize", "plait.engine", "plait.param_server"),
    ("plait.ft",),
    ("plait.train",),
    ("plait.certification",),
    ("plait.cli",),
    ("plait.__init__", "plait.__main__"),
]
NEVER: list[tuple[str, str, str]] = [
    ("plait.models", "plait.data", "models and data are independent of each other"),
    ("plait.data", "plait.models", "models and data are independent of each other"),
    *(
        ("plait.param_server", below, "the parameter server is a sibling system: no Comm, Mesh, paradigm or Engine")
        for below in (
            "plait.comm",
            "plait.mesh",
            "plait.parallel",
            "plait.planner",
            "plait.engine",
            "plait.parallelize",
        )
    ),
    ("plait.engine", "plait.param_server", "the engine and the parameter server are siblings"),
    ("plait.parallelize", "plait.param_server", "the engine and the parameter server are siblings"),
]
"""Imports that the layer order alone would allow but the design forbids."""


def _layer(module: str) -> int:
    best, found = -1, None
    for index, names in enumerate(LAYERS):
        for name in names:
            if (module == name or module.startswith(name + ".")) and len(name) > best:
                best, found = len(name), index
    if found is None:
        raise AssertionError(f"{module} is in no layer of LAYERS: add it (and to docs/design.md)")
    return found


def _module_name(path: Path) -> str:
    parts = path.relative_to(PLAIT.parent).with_suffix("").parts
    name = ".".join(parts)
    if name in ("plait.__init__", "plait.__main__"):
        return name
    return name.removesuffix(".__init__")


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, imported plait module) for every runtime import in ``path``."""
    tree = ast.parse(path.read_text(), str(path))
    package = _module_name(path)
    if path.name != "__init__.py":
        package = package.rpartition(".")[0]
    found: list[tuple[int, str]] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names if alias.name.split(".")[0] == "plait")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if module.split(".")[0] == "plait":
                if module == "plait":  # from plait import x: x is a module or a public name of the top level
                    for alias in node.names:
                        candidate = f"plait.{alias.name}"
                        sub = PLAIT / alias.name
                        is_module = sub.is_dir() or sub.with_suffix(".py").exists()
                        found.append((node.lineno, candidate if is_module else "plait.__init__"))
                else:
                    found.append((node.lineno, module))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def _violations() -> list[str]:
    problems = []
    for path in sorted(PLAIT.rglob("*.py")):
        importer = _module_name(path)
        own = _layer(importer)
        for line, imported in _imports(path):
            if imported == "plait" or imported.startswith(importer + "."):
                continue
            layer = _layer(imported)
            where = f"{path.relative_to(PLAIT.parent)}:{line}"
            if layer > own:
                problems.append(f"{where}: {importer} (layer {own}) imports {imported} (layer {layer}), a layer above")
            for low, high, why in NEVER:
                if (importer == low or importer.startswith(low + ".")) and (
                    imported == high or imported.startswith(high + ".")
                ):
                    problems.append(f"{where}: {importer} imports {imported}: {why}")
    return problems


def test_no_module_imports_upward():
    problems = _violations()
    assert not problems, "layering rules of docs/design.md broken:\n" + "\n".join(problems)


def test_every_module_has_a_layer():
    for path in PLAIT.rglob("*.py"):
        _layer(_module_name(path))


def test_the_checker_sees_an_upward_import(tmp_path, monkeypatch):
    """The rule can fail: a parallel module importing the engine is reported, a TYPE_CHECKING one is not."""
    fake = tmp_path / "plait"
    (fake / "parallel").mkdir(parents=True)
    (fake / "parallel" / "bad.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from plait.train.loop import run\n"
        "def f():\n    from plait.engine import Engine\n"
    )
    monkeypatch.setattr(__import__(__name__), "PLAIT", fake)
    problems = _violations()
    assert len(problems) == 1 and "imports plait.engine" in problems[0], problems


@pytest.mark.parametrize(
    "module, layer", [("plait.parallel.zero.fsdp", 6), ("plait.cli.main", 13), ("plait.layout", 1)]
)
def test_layers_of_known_modules(module, layer):
    assert _layer(module) == layer


def test_no_test_imports_another_test_file():
    """Shared test code lives in tests/helpers/, never in a test_*.py that other tests import."""
    tests = Path(__file__).resolve().parent
    problems = []
    for path in sorted(tests.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = (
                [alias.name for alias in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            problems += [f"{path.relative_to(tests)}:{node.lineno} imports {n}" for n in names if n.startswith("test_")]
    assert not problems, "tests import other test files; move the shared code to tests/helpers/:\n" + "\n".join(
        problems
    )
