"""Qwen-format tool calls: parsing, and every way a call can fail coming back as the text the
model reads (counted), never as an exception."""

import threading

import pytest

from grpo_core.tool_calls import ToolCall, ToolRunner, parse_tool_calls, response_messages, tool_schema


class Add:
    name, description = "add", "Add two numbers."
    parameters = {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                  "required": ["a", "b"], "additionalProperties": False}

    def __call__(self, arguments):
        return str(arguments["a"] + arguments["b"])


class Broken:
    name, description, parameters = "broken", "Always fails.", {"type": "object", "properties": {}}

    def __call__(self, arguments):
        raise RuntimeError("disk on fire")


class Waits:
    """Returns once `parties` calls wait together: passes only when calls run concurrently."""

    name, description, parameters = "wait", "Waits for the others.", {"type": "object", "properties": {}}

    def __init__(self, parties):
        self.barrier, self.release = threading.Barrier(parties, timeout=5), threading.Event()

    def __call__(self, arguments):
        if arguments.get("forever"):
            self.release.wait(30)
            return "released"
        self.barrier.wait()
        return "met"


@pytest.fixture
def runner():
    runner = ToolRunner([Add(), Broken()], timeout_seconds=5)
    yield runner
    runner.close()


def test_parses_every_complete_block():
    text = ('I will add.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
            '<tool_call>{"name":"add","arguments":"{\\"a\\": 3, \\"b\\": 4}"}</tool_call>\n<tool_call>\n{"name": "add"')
    assert parse_tool_calls(text) == [ToolCall("add", {"a": 1, "b": 2}), ToolCall("add", {"a": 3, "b": 4})]
    assert parse_tool_calls("no calls here") == []


@pytest.mark.parametrize("block, expected", [
    ('{"name": "add", "arguments": {"a": 1,}}', "Error: the tool call is not valid JSON (Expecting property name"),
    ('{"arguments": {}}', 'Error: the tool call needs a string "name"'),
    ('[1, 2]', 'Error: the tool call needs a string "name"'),
    ('{"name": "add", "arguments": [1, 2]}', "Error: the arguments of tool 'add' must be a JSON object, got [1, 2]"),
    ('{"name": "mul", "arguments": {}}', "Error: unknown tool 'mul'; available: add, broken"),
    ('{"name": "add", "arguments": {"a": 1}}', "Error: bad arguments for tool 'add': missing required argument 'b'"),
    ('{"name": "add", "arguments": {"a": 1, "b": "2"}}', "Error: bad arguments for tool 'add': argument 'b' must be number, got string"),
    ('{"name": "add", "arguments": {"a": true, "b": 2}}', "Error: bad arguments for tool 'add': argument 'a' must be number, got boolean"),
    ('{"name": "add", "arguments": {"a": 1, "b": 2, "c": 3}}', "Error: bad arguments for tool 'add': unexpected argument 'c'; expected: a, b"),
    ('{"name": "broken", "arguments": {}}', "Error: tool 'broken' failed: RuntimeError: disk on fire"),
])
def test_a_failed_call_is_the_response_the_model_reads(runner, block, expected):
    [outcome] = runner.run(parse_tool_calls(f"<tool_call>\n{block}\n</tool_call>"))
    assert outcome.status == "error" and outcome.response.startswith(expected), outcome.response
    assert (runner.stats.calls, runner.stats.errors, runner.stats.timeouts) == (1, 1, 0)


def test_calls_run_concurrently_in_order_and_are_counted():
    waits = Waits(parties=3)
    runner = ToolRunner([waits, Add()], timeout_seconds=10)
    calls = [ToolCall("wait", {}), ToolCall("add", {"a": 2, "b": 3}), ToolCall("wait", {}), ToolCall("wait", {})]
    try:
        outcomes = runner.run(calls)
    finally:
        runner.close()
    assert [outcome.response for outcome in outcomes] == ["met", "5", "met", "met"]
    assert runner.stats.metrics()["tools/calls"] == 4.0 and runner.stats.errors == 0


def test_a_call_past_its_timeout_is_answered_and_counted():
    waits = Waits(parties=1)
    runner = ToolRunner([waits, Add()], timeout_seconds=0.2)
    try:
        slow, fast = runner.submit([ToolCall("wait", {"forever": True}), ToolCall("add", {"a": 1, "b": 1})]).result()
    finally:
        waits.release.set()
        runner.close()
    assert (slow.status, slow.response) == ("timeout", "Error: tool 'wait' timed out after 0.2 s")
    assert (fast.status, fast.response) == ("ok", "2")
    assert (runner.stats.calls, runner.stats.timeouts, runner.stats.errors) == (2, 1, 0)


def test_long_responses_are_cut():
    class Loud(Add):
        name = "loud"

        def __call__(self, arguments):
            return "x" * 100

    runner = ToolRunner([Loud()], max_response_chars=10)
    [outcome] = runner.run([ToolCall("loud", {"a": 1, "b": 1})])
    runner.close()
    assert outcome.response == "x" * 10 + "\n[response cut at 10 characters]"


def test_tools_are_offered_and_answered_in_the_template_format():
    assert tool_schema(Add()) == {"type": "function", "function": {
        "name": "add", "description": "Add two numbers.", "parameters": Add.parameters}}
    runner = ToolRunner([Add()])
    outcomes = runner.run([ToolCall("add", {"a": 1, "b": 2})])
    runner.close()
    assert response_messages(outcomes) == [{"role": "tool", "name": "add", "content": "3"}]


def test_two_tools_with_one_name_are_refused():
    with pytest.raises(ValueError, match="two tools are named 'add'; give each offered tool its own name"):
        ToolRunner([Add(), Add()])
