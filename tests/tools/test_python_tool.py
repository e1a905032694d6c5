"""The built-in tools as a run finds them: through the `grpo` entry point, built from their
spec with options, called through the ToolRunner (several calls at once)."""

import json

import pytest

from grpo_core.errors import UserError
from grpo_core.registry import build_registry
from grpo_core.tool_calls import ToolRunner, parse_tool_calls
from grpo_tools import python_tool
from grpo_tools.sandbox_cgroup import usable_layout


def test_the_entry_point_registers_both_tools():
    registry = build_registry()
    assert {"calculator", "python"} <= set(registry.names("tool"))
    assert {registry.provided("tool", name).distribution for name in ("calculator", "python")} == {"grpo-tools"}


@pytest.fixture(scope="module")
def python_runner():
    spec = build_registry().tool("python")
    tool = spec.factory(spec.options(wall_seconds=5.0, cpu_seconds=30, memory_mib=256, output_kib=1))
    runner = ToolRunner([tool, build_registry().tool("calculator").factory(None)], timeout_seconds=20)
    yield runner
    runner.close()


def test_a_turn_of_python_calls_runs_concurrently_and_answers_each(python_runner):
    text = "".join(f"<tool_call>\n{json.dumps({'name': 'python', 'arguments': {'code': code}})}\n</tool_call>"
                   for code in ("print(12 * 34)", "1/0", "while True: pass", "print(len('x' * 5000))"))
    outcomes = python_runner.run(parse_tool_calls(text))
    responses = [outcome.response for outcome in outcomes]
    assert responses[0] == "408\n"
    assert "ZeroDivisionError" in responses[1] and responses[1].endswith("[exit status 1]\n")
    assert responses[2] == "(no output)\n[stopped: wall-clock limit]\n"
    assert responses[3] == "5000\n"
    assert [outcome.status for outcome in outcomes] == ["ok"] * 4


def test_over_long_code_is_the_model_s_error(python_runner):
    [outcome] = python_runner.run(parse_tool_calls(
        '<tool_call>{"name": "python", "arguments": {"code": "' + "#" * 30_000 + '"}}</tool_call>'))
    assert outcome.status == "error" and outcome.response == "Error: the code is too long (30000 characters; at most 20000)"


def test_without_a_sandbox_the_tool_is_refused_in_one_line(monkeypatch):
    monkeypatch.setattr(python_tool, "sandbox_problem", lambda limits: "the python tool's sandbox does not start here (x)")
    with pytest.raises(UserError, match=r"^the python tool's sandbox does not start here \(x\)$"):
        python_tool.PythonTool()


def test_the_limit_note_survives_the_runner_s_cut(python_runner):
    """The runner cuts the body at max_response_chars; the model still reads why the code stopped."""
    runner = ToolRunner([python_runner.tools["python"]], max_response_chars=200)
    try:
        [outcome] = runner.run(parse_tool_calls(
            '<tool_call>{"name": "python", "arguments": {"code": "print(\'x\' * 5000)"}}</tool_call>'))
    finally:
        runner.close()
    assert outcome.response == "x" * 200 + "\n[response cut at 200 characters]\n[stopped: output limit]\n"


def test_the_tool_says_at_its_first_call_which_memory_bound_holds(capsys, monkeypatch):
    monkeypatch.setattr(python_tool, "_REPORTED", set())
    tool = python_tool.PythonTool(python_tool.PythonOptions(memory_mib=256, processes=8))
    assert capsys.readouterr().err == ""  # building it (config checks, refusals) prints nothing
    assert tool({"code": "print(1)"}) == "1\n"
    line = capsys.readouterr().err
    assert line.startswith("python tool sandbox: ") and line.count("\n") == 1, line
    tool({"code": "print(2)"})
    assert capsys.readouterr().err == ""  # once per process
    layout, _ = usable_layout()
    per_call = f"for each call as a whole (cgroup v{layout.version} under {layout.memory_parent})\n" if layout else ""
    fallback = "memory is bounded per process only: 256 MiB of address space x 10 processes = up to 2560 MiB per call\n"
    assert line.endswith(per_call or fallback), line
