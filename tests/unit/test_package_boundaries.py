"""The package map of docs/architecture.md holds: who may import whom, where tooling lives."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LIBRARY = ("kvindex", "routing", "gateway")
TOOLING = {"bench", "tests", "cli"}
FORBIDDEN = {
    "kvindex": {"routing", "gateway", *TOOLING},
    "routing": {"gateway", *TOOLING},
    "gateway": TOOLING,
    "bench": {"tests", "cli"},
    "cli": {"tests"},
}


def imported_packages(tree: ast.AST) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def is_main_guard(node: ast.AST) -> bool:
    """``if __name__ == "__main__":`` (either side of the ``==``)."""
    if not (isinstance(node, ast.If) and isinstance(node.test, ast.Compare)):
        return False
    sides = [node.test.left, *node.test.comparators]
    names = {s.id for s in sides if isinstance(s, ast.Name)}
    values = {s.value for s in sides if isinstance(s, ast.Constant)}
    return names == {"__name__"} and values == {"__main__"}


def script_parts(root: Path, package: str) -> list[str]:
    """What makes a module of ``package`` a command: a ``__main__.py``, a main guard,
    or argument parsing."""
    found = []
    for path in sorted((root / package).rglob("*.py")):
        where = str(path.relative_to(root))
        tree = ast.parse(path.read_text())
        if path.name == "__main__.py":
            found.append(f"{where}: is a __main__ module")
        if any(is_main_guard(node) for node in ast.walk(tree)):
            found.append(f"{where}: has an `if __name__ == '__main__'` block")
        if "argparse" in imported_packages(tree):
            found.append(f"{where}: imports argparse")
    return found


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_imports_only_what_the_map_allows(package):
    offenders = {
        str(path.relative_to(ROOT)): sorted(
            imported_packages(ast.parse(path.read_text())) & FORBIDDEN[package]
        )
        for path in (ROOT / package).rglob("*.py")
    }
    assert {k: v for k, v in offenders.items() if v} == {}


@pytest.mark.parametrize("package", LIBRARY)
def test_library_packages_are_not_commands(package):
    """Commands (and their flags) live in cli/ and bench/, never in the library."""
    assert script_parts(ROOT, package) == []


def test_a_main_guard_a_main_module_and_argparse_are_each_found(tmp_path):
    pkg = tmp_path / "lib"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__main__.py").write_text("print('run')\n")
    (pkg / "tool.py").write_text("import argparse\n\nif '__main__' == __name__:\n    pass\n")
    (pkg / "sub" / "flags.py").write_text("from argparse import ArgumentParser\n")
    (pkg / "clean.py").write_text("name = __name__\nif __name__ == 'lib.clean':\n    pass\n")

    assert script_parts(tmp_path, "lib") == [
        "lib/__main__.py: is a __main__ module",
        "lib/sub/flags.py: imports argparse",
        "lib/tool.py: has an `if __name__ == '__main__'` block",
        "lib/tool.py: imports argparse",
    ]
