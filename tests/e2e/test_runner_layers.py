"""The runner's folders are layers: a module imports only from its own layer and those below
it, so the architecture reads from the bottom up (docs/architecture.md). Every import counts,
those inside functions too; `TYPE_CHECKING` blocks do not (they never run)."""

import ast
from pathlib import Path

# Lowest first. A top-level module (`grpo_runner_gsm8k/<name>.py`) is its own entry.
LAYERS = (
    ("environ", "multihost", "tokens"),  # leaves: process environment, multi-host gathers, prompt text
    ("costs",),                           # FLOPs, bytes, seconds, capacity, the chip table
    ("operations", "tasks"),              # checkpoints, lock, preemption, metrics; tasks, answers, rewards
    ("training",),                        # the jitted update, advantages, scoring, loss inputs
    ("samplers",),                        # plain, refill, partial, multi-turn step samplers
    ("evaluation",),                      # sampling and grading for eval, in training and `grpo-run eval`
    ("assembly",),                        # the one builder: config -> BuiltRun
    ("loop", "plan"),                     # the Trainer; the planner (never imported by the loop)
    ("commands", "cli", "plugin"),        # what the user runs, and the entry point's registrations
)
PACKAGE = "grpo_runner_gsm8k"


def layer_of(part: str) -> int:
    for index, names in enumerate(LAYERS):
        if part in names:
            return index
    raise AssertionError(f"{PACKAGE}.{part} is in no layer of tests/e2e/test_runner_layers.py: add it to one")


def runtime_imports(tree: ast.AST):
    """Imported module names, skipping `if TYPE_CHECKING:` blocks."""
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(n) for child in node.body for n in ast.walk(child))
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == PACKAGE:
                yield from (f"{PACKAGE}.{alias.name}" for alias in node.names)
            else:
                yield node.module
        elif isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)


def upward_imports(source: Path) -> list[str]:
    found = []
    for path in sorted(source.rglob("*.py")):
        part = path.relative_to(source).parts[0].removesuffix(".py")
        if part == "__init__":
            continue
        for name in runtime_imports(ast.parse(path.read_text())):
            pieces = name.split(".")
            if pieces[0] != PACKAGE or len(pieces) < 2 or pieces[1] == part:
                continue
            if layer_of(pieces[1]) > layer_of(part) or (part == "loop" and pieces[1] == "plan"):
                found.append(f"{path.relative_to(source)} imports {name}")
    return found


def test_no_runner_module_imports_from_a_layer_above_its_own(repo_root):
    source = repo_root / "packages" / "runner-gsm8k" / "src" / PACKAGE
    assert upward_imports(source) == []


def test_an_upward_import_is_found(tmp_path):
    source = tmp_path / PACKAGE
    (source / "costs").mkdir(parents=True)
    (source / "costs" / "roofline.py").write_text("def f():\n    from grpo_runner_gsm8k.assembly.run import build_run\n")
    (source / "loop.py").write_text("import grpo_runner_gsm8k.plan.report\n")
    (source / "tokens.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                      "    from grpo_runner_gsm8k.assembly.run import BuiltRun\n")
    assert upward_imports(source) == ["costs/roofline.py imports grpo_runner_gsm8k.assembly.run",
                                      "loop.py imports grpo_runner_gsm8k.plan.report"]
