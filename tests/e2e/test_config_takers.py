"""Few functions take the whole RunConfig: outside config loading, only the entry points (train,
the planner's entry, the command handlers) and the builders of a run. Every other function takes
the section it reads (`cfg.rollout`, `cfg.loss`, ...) or plain values, so its signature says what
it depends on.

A taker is a function with a parameter annotated `RunConfig` (bare, quoted, `Optional[...]` or
`grpo_core.config.RunConfig`). Not counted, as config loading: grpo_core's config_io,
config_checks, config_teacher and config_notes, the runner's config-load checks (`build.check_inputs`, also run by
`--print-config`), and functions that return a changed copy of the config (`-> RunConfig`), which
need all of it."""

from __future__ import annotations

import ast
from pathlib import Path

MAX_TAKERS = 8
# config_notes runs inside config_io.load_config: its checks are part of loading the config
CONFIG_LOADING_MODULES = {"grpo_core/config_io.py", "grpo_core/config_checks.py", "grpo_core/config_teacher.py",
                          "grpo_core/config_notes.py"}
CONFIG_LOADING_FUNCTIONS = {("grpo_runner_gsm8k/assembly/build.py", "check_inputs")}


def names_run_config(annotation: ast.expr | None) -> bool:
    """Whether an annotation mentions RunConfig (a string annotation is parsed first)."""
    if annotation is None:
        return False
    for node in ast.walk(annotation):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            try:
                if names_run_config(ast.parse(node.value, mode="eval").body):
                    return True
            except SyntaxError:
                continue
        if (isinstance(node, ast.Name) and node.id == "RunConfig") or (
                isinstance(node, ast.Attribute) and node.attr == "RunConfig"):
            return True
    return False


def takes_run_config(function: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    args = function.args
    parameters = [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]
    return any(p is not None and names_run_config(p.annotation) for p in parameters)


def defined_functions(tree: ast.Module) -> list[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """(qualified name, node) of every function and method, nested ones included."""
    found = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found.append((prefix + child.name, child))
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")

    visit(tree, "")
    return found


def config_takers(packages: Path) -> list[str]:
    """`module.py:line name` of every function outside config loading that takes a RunConfig."""
    found = []
    for path in sorted(packages.glob("*/src/**/*.py")):
        module = "/".join(path.relative_to(packages).parts[2:])  # past <member>/src/
        if module in CONFIG_LOADING_MODULES:
            continue
        for name, function in defined_functions(ast.parse(path.read_text(), str(path))):
            if (module, name) in CONFIG_LOADING_FUNCTIONS or names_run_config(function.returns):
                continue
            if takes_run_config(function):
                found.append(f"{module}:{function.lineno} {name}")
    return found


def test_at_most_8_functions_outside_config_loading_take_a_run_config(repo_root):
    takers = config_takers(repo_root / "packages")
    assert len(takers) <= MAX_TAKERS, (
        f"{len(takers)} functions take the whole RunConfig (at most {MAX_TAKERS}); pass the section(s) each "
        "reads instead:\n" + "\n".join(takers))


def test_every_way_of_writing_the_annotation_is_found(tmp_path):
    source = tmp_path / "runner" / "src" / "grpo_runner_gsm8k"
    (source / "assembly").mkdir(parents=True)
    (source / "assembly" / "run.py").write_text(
        "from typing import Optional\nimport grpo_core.config\n"
        "def bare(cfg: RunConfig): ...\n"
        "def quoted(x, *, cfg: 'RunConfig'): ...\n"
        "def optional(cfg: Optional[RunConfig] = None): ...\n"
        "def dotted(cfg: grpo_core.config.RunConfig): ...\n"
        "class Built:\n    def method(self, cfg: RunConfig): ...\n"
        "def derived(cfg: RunConfig) -> RunConfig: ...\n"
        "def section(rollout: RolloutConfig, cfg=None): ...\n")
    (source / "assembly" / "build.py").write_text("def check_inputs(cfg: RunConfig): ...\ndef other(cfg: RunConfig): ...\n")
    (tmp_path / "core" / "src" / "grpo_core").mkdir(parents=True)
    (tmp_path / "core" / "src" / "grpo_core" / "config_io.py").write_text("def load(cfg: RunConfig): ...\n")
    assert config_takers(tmp_path) == [
        "grpo_runner_gsm8k/assembly/build.py:2 other", "grpo_runner_gsm8k/assembly/run.py:3 bare",
        "grpo_runner_gsm8k/assembly/run.py:4 quoted", "grpo_runner_gsm8k/assembly/run.py:5 optional", "grpo_runner_gsm8k/assembly/run.py:6 dotted",
        "grpo_runner_gsm8k/assembly/run.py:8 Built.method"]
