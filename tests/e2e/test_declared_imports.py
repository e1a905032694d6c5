"""Every workspace member imports only what its own pyproject declares (or the standard
library), and its tests only what installing it brings: a module that needs another member or a third-party package
must say so, or it breaks for whoever installs that member alone. Every import counts,
those inside functions too; an import guarded by `except ImportError` is optional and may
name anything."""

import ast
import functools
import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

import pytest

MEMBERS = ("core", "losses", "meshes", "rollout", "runner-gsm8k", "tools")
# The test-only packages every member's tests may use beside what the member declares.
TEST_TOOLS = {"pytest", "hypothesis", "_pytest", "kubernetes"}  # the dev group of the root pyproject.toml


def guarded(tree: ast.AST) -> set[int]:
    """ids of import nodes inside a `try` that catches ImportError (optional imports)."""
    optional = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Try) and any(_catches_import_error(h) for h in node.handlers):
            optional |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return optional


def _catches_import_error(handler: ast.ExceptHandler) -> bool:
    names = ast.unparse(handler.type) if handler.type is not None else ""
    return "ImportError" in names or "ModuleNotFoundError" in names or handler.type is None


def top_level_imports(paths) -> dict[str, str]:
    """Top-level module name -> one place importing it, over absolute imports of `paths`."""
    found = {}
    for path in paths:
        tree = ast.parse(path.read_text(), str(path))
        optional = guarded(tree)
        for node in ast.walk(tree):
            if id(node) in optional:
                continue
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module]
            else:
                continue
            for name in names:
                found.setdefault(name.split(".")[0], f"{path}:{node.lineno}")
    return found


def declared_modules(member_dir: Path) -> set[str]:
    """Import names of the member itself and of every distribution its pyproject names."""
    project = tomllib.loads((member_dir / "pyproject.toml").read_text())["project"]
    dists = {_dist_name(spec) for spec in project["dependencies"]}
    providers = _providers()
    own = {p.name for p in (member_dir / "src").iterdir() if p.is_dir()}
    members = {d.replace("-", "_") for d in dists if d.startswith("grpo-")}  # editable: not in RECORD files
    return own | members | {module for module, names in providers.items() if dists & {_normal(n) for n in names}}


@functools.cache
def _providers() -> dict[str, list[str]]:
    return importlib.metadata.packages_distributions()


def _dist_name(spec: str) -> str:
    return _normal(re.split(r"[<>=!~\[; ]", spec, maxsplit=1)[0])


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def installed_with(member_dir: Path) -> set[str]:
    """Import names of everything installing the member brings (its dependencies' dependencies too)."""
    project = tomllib.loads((member_dir / "pyproject.toml").read_text())["project"]
    todo, seen = [_dist_name(spec) for spec in project["dependencies"]], set()
    while todo:
        dist = todo.pop()
        if dist in seen:
            continue
        seen.add(dist)
        try:
            requires = importlib.metadata.requires(dist) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        todo += [_dist_name(r) for r in requires if "extra ==" not in r]
    providers = _providers()
    members = {d.replace("-", "_") for d in seen if d.startswith("grpo-")}
    return members | {module for module, names in providers.items() if seen & {_normal(n) for n in names}}


def undeclared(repo: Path, member: str) -> list[str]:
    member_dir = repo / "packages" / member
    allowed = declared_modules(member_dir) | set(sys.stdlib_module_names) | {"__future__"}
    sources = list((member_dir / "src").rglob("*.py"))
    test_dir = repo / "tests" / ("runner" if member == "runner-gsm8k" else member)
    # make_*.py regenerate golden files with torch, outside the test run
    test_files = [p for p in test_dir.rglob("*.py") if not p.name.startswith("make_")] if test_dir.is_dir() else []
    installed = installed_with(member_dir) | allowed
    found = {m: where for m, where in top_level_imports(sources).items() if m not in allowed}
    found |= {m: where for m, where in top_level_imports(test_files).items()
              if m not in installed | TEST_TOOLS | {"conftest"}}
    return sorted(f"{m} ({where})" for m, where in found.items())


@pytest.mark.parametrize("member", MEMBERS)
def test_a_member_imports_only_what_it_declares(repo_root, member):
    assert undeclared(repo_root, member) == []


def test_an_undeclared_import_is_found_in_a_function_and_in_a_test(tmp_path):
    member = tmp_path / "packages" / "demo"
    (member / "src" / "demo").mkdir(parents=True)
    (member / "pyproject.toml").write_text('[project]\nname = "demo"\ndependencies = ["pyyaml>=6"]\n')
    (member / "src" / "demo" / "a.py").write_text("import yaml\nimport json\n\n\ndef f():\n    import numpy\n")
    (tmp_path / "tests" / "demo").mkdir(parents=True)
    (tmp_path / "tests" / "demo" / "test_a.py").write_text(
        "import pytest\ntry:\n    import torch\nexcept ImportError:\n    torch = None\nimport matplotlib\n")
    assert [line.split(" ")[0] for line in undeclared(tmp_path, "demo")] == ["matplotlib", "numpy"]
