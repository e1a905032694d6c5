"""Code stays in pieces one can read: no function in packages/ or examples/ is over 40 lines
(decorators and docstrings included), so each reads as one job, and no module is over 400
lines, so each holds one subject."""

import ast

MAX_LINES = 40
MAX_MODULE_LINES = 400


def long_functions(root) -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - min([node.lineno, *(d.lineno for d in node.decorator_list)]) + 1
                if lines > MAX_LINES:
                    found.append(f"{path.relative_to(root.parent)}:{node.lineno} {node.name} ({lines} lines)")
    return found


def long_modules(root) -> list[str]:
    counts = {path: len(path.read_text().splitlines()) for path in sorted(root.rglob("*.py"))}
    return [f"{path.relative_to(root.parent)} ({n} lines)" for path, n in counts.items() if n > MAX_MODULE_LINES]


def test_no_function_is_over_40_lines(repo_root):
    assert long_functions(repo_root / "packages") + long_functions(repo_root / "examples") == []


def test_no_module_is_over_400_lines(repo_root):
    assert long_modules(repo_root / "packages") + long_modules(repo_root / "examples") == []


def test_a_long_function_is_found(tmp_path):
    (tmp_path / "pkg").mkdir()
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_LINES))
    (tmp_path / "pkg" / "long.py").write_text(f"def short():\n    return 1\n\n\ndef long():\n{body}\n")
    assert long_functions(tmp_path / "pkg") == [f"pkg/long.py:5 long ({MAX_LINES + 1} lines)"]


def test_a_long_module_is_found(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "short.py").write_text("x = 1\n" * MAX_MODULE_LINES)
    (tmp_path / "pkg" / "long.py").write_text("x = 1\n" * (MAX_MODULE_LINES + 1))
    assert long_modules(tmp_path / "pkg") == [f"pkg/long.py ({MAX_MODULE_LINES + 1} lines)"]
