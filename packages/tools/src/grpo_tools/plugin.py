"""Entry point of the built-in tools (registered like any third-party plugin)."""

from grpo_core import NoOptions, ToolSpec, hookimpl
from grpo_tools.calculator import Calculator
from grpo_tools.python_tool import PythonOptions, PythonTool


@hookimpl
def grpo_tools():
    return [
        ToolSpec("calculator", Calculator, NoOptions, "Exact arithmetic (+ - * / // % **), parsed, never eval'd"),
        ToolSpec("python", PythonTool, PythonOptions, "Runs Python in a sandbox: no network, own files only, limits"),
    ]
