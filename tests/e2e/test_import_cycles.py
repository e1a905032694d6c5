"""No module of the workspace imports, directly or through others, a module that imports it
back: every `import` and `from ... import` counts, those inside functions too. A cycle that
works only because of import order (or a lazy import hiding it) is one refactor from an
ImportError, and it blurs which layer stands above which."""

import ast
from pathlib import Path

import pytest


def module_paths(packages: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every `packages/*/src/<top>/**.py`."""
    found = {}
    for src in packages.glob("*/src"):
        for path in src.rglob("*.py"):
            parts = path.relative_to(src).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imported_names(node: ast.AST, module: str, is_package: bool) -> list[str]:
    """Dotted names an import statement brings in: `from a import b` names a and a.b."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:
        anchor = module.split(".")[: len(module.split(".")) - node.level + is_package]
        base = ".".join(anchor + ([node.module] if node.module else []))
    return [base] + [f"{base}.{alias.name}" for alias in node.names]


def type_checking_only(tree: ast.AST) -> set[int]:
    """ids of the nodes under `if TYPE_CHECKING:`: never imported at run time, so no cycle."""
    return {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and ast.unparse(node.test).endswith(
        "TYPE_CHECKING") for stmt in node.body for n in ast.walk(stmt)}


def import_graph(packages: Path) -> dict[str, set[str]]:
    paths = module_paths(packages)
    graph = {}
    for module, path in paths.items():
        targets, tree = set(), ast.parse(path.read_text(), str(path))
        skipped = type_checking_only(tree)
        for node in ast.walk(tree):
            if id(node) in skipped:
                continue
            for name in imported_names(node, module, path.name == "__init__.py"):
                while name and name not in paths:
                    name = name.rpartition(".")[0]
                if name and name != module:
                    targets.add(name)
        graph[module] = targets
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root), on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while not component or component[-1] != node:
                        component.append(stack.pop())
                        on_stack.discard(component[-1])
                    if len(component) > 1:
                        found.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child), on_stack.add(child)
                work.append((child, iter(sorted(graph.get(child, ())))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return found


def test_no_package_has_an_import_cycle(repo_root):
    assert cycles(import_graph(repo_root / "packages")) == []


def test_the_training_loop_imports_nothing_from_the_planner(repo_root):
    graph = import_graph(repo_root / "packages")
    assert graph["grpo_runner_gsm8k.loop"], "the loop module was not found"
    assert [m for m in graph["grpo_runner_gsm8k.loop"] if m.startswith("grpo_runner_gsm8k.plan")] == []


@pytest.mark.parametrize("lazy", [False, True])
def test_a_cycle_is_found_even_through_a_function_level_import(tmp_path, lazy):
    src = tmp_path / "packages" / "demo" / "src" / "demo"
    (src / "sub").mkdir(parents=True)
    (src / "__init__.py").write_text("")
    (src / "a.py").write_text("from demo.sub.b import f\n")
    (src / "sub" / "__init__.py").write_text("")
    back = "def g():\n    from .. import a\n" if lazy else "from demo.a import *\n"
    (src / "sub" / "b.py").write_text("if TYPE_CHECKING:\n    from demo.a import f\n")
    assert cycles(import_graph(tmp_path / "packages")) == []
    (src / "sub" / "b.py").write_text(back + "def f():\n    return 1\n")
    assert cycles(import_graph(tmp_path / "packages")) == [["demo.a", "demo.sub.b"]]
    (src / "sub" / "b.py").write_text("def f():\n    return 1\n")
    assert cycles(import_graph(tmp_path / "packages")) == []
