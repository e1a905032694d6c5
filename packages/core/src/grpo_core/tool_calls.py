"""Tool calls in the Qwen2.5 / Qwen3 format, parsed from decoded text and run.

The model writes each call as

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "12 * 34"}}
    </tool_call>

`parse_tool_calls` finds every complete block; `ToolRunner` runs a turn's calls concurrently,
each with a timeout, and turns every failure (malformed JSON, an unknown tool, bad arguments,
an exception, a timeout) into the response text the model reads, counted in `ToolStats`:
the errors are the model's, never the run's. `grpo_core.chat_turns` renders the responses
as the tokens to append.
"""

from __future__ import annotations

import concurrent.futures as futures
import json
import re
import threading
import time
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from grpo_core.multi_turn import Tool, ToolError

CALL_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)
CLOSING_NOTES = re.compile(r"(?:^\[[^\[\]\n]{1,80}\]\n){1,3}\Z", re.M)  # e.g. "[stopped: output limit]\n"
JSON_TYPES = {"string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,),
              "object": (dict,), "array": (list,), "null": (type(None),)}
CALL_FORMAT = '<tool_call>\n{"name": <tool name>, "arguments": {<argument>: <value>, ...}}\n</tool_call>'


@dataclass(frozen=True)
class ToolCall:
    """One `<tool_call>` block: the tool's name and arguments, or `error`, the response the
    model gets when the block is not a usable call (then name/arguments may be None)."""

    name: str | None
    arguments: Mapping[str, Any] | None
    error: str | None = None


def _parse_block(body: str) -> ToolCall:
    try:
        call = json.loads(body)
    except json.JSONDecodeError as exc:
        return ToolCall(None, None, f"Error: the tool call is not valid JSON ({exc.msg} at character {exc.pos}); "
                                    f"write {CALL_FORMAT}")
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return ToolCall(None, None, f'Error: the tool call needs a string "name"; write {CALL_FORMAT}')
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    if not isinstance(arguments, dict):
        return ToolCall(call["name"], None, f"Error: the arguments of tool {call['name']!r} must be a JSON object, "
                                            f"got {json.dumps(arguments)[:80]}")
    return ToolCall(call["name"], arguments)


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Every complete `<tool_call>...</tool_call>` block of `text`, in order (an unclosed
    block, e.g. cut by the token budget, is not a call)."""
    return [_parse_block(body.strip()) for body in CALL_BLOCK.findall(text)]


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    return next((name for name, kinds in JSON_TYPES.items() if isinstance(value, kinds)), type(value).__name__)


def argument_problem(tool: Tool, arguments: Mapping[str, Any]) -> str | None:
    """What is wrong with `arguments` for `tool` (required keys, JSON types, unexpected keys
    when the schema forbids them), or None."""
    schema = tool.parameters
    properties = schema.get("properties", {})
    missing = [key for key in schema.get("required", ()) if key not in arguments]
    if missing:
        return f"missing required argument {missing[0]!r}"
    for key, value in arguments.items():
        if key not in properties:
            if schema.get("additionalProperties", True) is False:
                return f"unexpected argument {key!r}; expected: {', '.join(properties)}"
            continue
        expected = properties[key].get("type")
        allowed = [expected] if isinstance(expected, str) else list(expected or [])
        if allowed and not any(_matches(value, kind) for kind in allowed):
            return f"argument {key!r} must be {' or '.join(allowed)}, got {_json_type(value)}"
    return None


def _matches(value: Any, kind: str) -> bool:
    if isinstance(value, bool) and kind in ("integer", "number"):
        return False
    return isinstance(value, JSON_TYPES.get(kind, (object,)))


@dataclass
class ToolStats:
    """Counts of a rollout's tool calls. calls: every block; errors: calls answered with an
    error (malformed, unknown tool, bad arguments, an exception); timeouts: calls past their
    timeout; seconds: time spent in tools, summed over calls."""

    calls: int = 0
    errors: int = 0
    timeouts: int = 0
    seconds: float = 0.0

    def add(self, outcome: "ToolOutcome") -> None:
        self.calls += 1
        self.errors += outcome.status == "error"
        self.timeouts += outcome.status == "timeout"
        self.seconds += outcome.seconds

    def metrics(self, prefix: str = "tools/") -> dict[str, float]:
        return {f"{prefix}{name}": float(value) for name, value in vars(self).items()}


@dataclass(frozen=True)
class ToolOutcome:
    """What one call gave: the response the model reads and how the call ended
    (status "ok", "error" or "timeout"), with its wall-clock seconds."""

    call: ToolCall
    response: str
    status: str
    seconds: float = 0.0


class ToolRunner:
    """Runs tool calls on a thread pool: the calls of a turn concurrently, each with
    `timeout_seconds` from the start of the turn (calls beyond `max_workers` wait for a worker,
    and the wait counts); responses longer than `max_response_chars` are cut. A tool that
    ignores its timeout keeps its worker thread until it returns (the python tool stops
    itself at its own wall-clock limit)."""

    def __init__(self, tools: Sequence[Tool], *, timeout_seconds: float = 30.0, max_workers: int = 8,
                 max_response_chars: int = 4096):
        names = [tool.name for tool in tools]
        duplicates = sorted({name for name in names if names.count(name) > 1})
        if duplicates:
            raise ValueError(f"two tools are named {duplicates[0]!r}; give each offered tool its own name")
        if timeout_seconds <= 0 or max_response_chars <= 0:
            raise ValueError(f"ToolRunner needs a positive timeout and response size, got timeout_seconds="
                             f"{timeout_seconds}, max_response_chars={max_response_chars}")
        self.tools = {tool.name: tool for tool in tools}
        self.timeout_seconds, self.max_response_chars = timeout_seconds, max_response_chars
        self.stats = ToolStats()
        self._pool = futures.ThreadPoolExecutor(max_workers, thread_name_prefix="grpo-tool")
        self._turns = futures.ThreadPoolExecutor(max_workers, thread_name_prefix="grpo-tool-turn")
        self._lock = threading.Lock()

    def _cut(self, text: str) -> str:
        """At most `max_response_chars` of the body; a tool's closing notes (up to three short
        `[...]` lines at the very end, e.g. "[stopped: output limit]") are kept after the cut,
        beyond the limit, so the model still reads why its call ended."""
        text = text if isinstance(text, str) else str(text)
        if len(text) <= self.max_response_chars:
            return text
        notes = CLOSING_NOTES.search(text)
        body, kept = (text[: notes.start()], notes.group()) if notes else (text, "")
        if len(body) > self.max_response_chars:
            body = body[: self.max_response_chars] + f"\n[response cut at {self.max_response_chars} characters]"
            kept = "\n" + kept if kept else ""
        return body + kept

    def _call(self, call: ToolCall) -> ToolOutcome:
        """Runs one parsed call on this thread; every failure becomes an error response."""
        if call.error is not None:
            return ToolOutcome(call, call.error, "error")
        tool = self.tools.get(call.name)
        if tool is None:
            available = ", ".join(sorted(self.tools)) or "none"
            return ToolOutcome(call, f"Error: unknown tool {call.name!r}; available: {available}", "error")
        problem = argument_problem(tool, call.arguments)
        if problem:
            return ToolOutcome(call, f"Error: bad arguments for tool {call.name!r}: {problem}", "error")
        start = time.monotonic()
        try:
            response = self._cut(tool(call.arguments))
        except ToolError as exc:
            return ToolOutcome(call, f"Error: {exc}", "error", time.monotonic() - start)
        except Exception as exc:  # the tool's failure is the model's information, not the run's
            return ToolOutcome(call, f"Error: tool {call.name!r} failed: {type(exc).__name__}: {exc}", "error",
                               time.monotonic() - start)
        return ToolOutcome(call, response, "ok", time.monotonic() - start)

    def run(self, calls: Sequence[ToolCall]) -> list[ToolOutcome]:
        """Runs `calls` concurrently and returns their outcomes in order (blocks for at most
        about `timeout_seconds`)."""
        start = time.monotonic()
        pending = [self._pool.submit(self._call, call) for call in calls]
        outcomes = []
        for call, future in zip(calls, pending):
            left = max(0.0, self.timeout_seconds - (time.monotonic() - start))
            try:
                outcomes.append(future.result(timeout=left))
            except futures.TimeoutError:
                outcomes.append(ToolOutcome(call, f"Error: tool {call.name!r} timed out after "
                                                  f"{self.timeout_seconds:g} s", "timeout", self.timeout_seconds))
        with self._lock:
            for outcome in outcomes:
                self.stats.add(outcome)
        return outcomes

    def submit(self, calls: Sequence[ToolCall]) -> "futures.Future[list[ToolOutcome]]":
        """`run(calls)` in the background: a row waiting on its tools holds up no other row."""
        return self._turns.submit(self.run, calls)

    def close(self) -> None:
        self._turns.shutdown(wait=False, cancel_futures=True)
        self._pool.shutdown(wait=False, cancel_futures=True)

    def offered(self) -> list[dict[str, Any]]:
        """The tools as a chat template's `tools=` argument takes them (JSON-schema functions)."""
        return [tool_schema(tool) for tool in self.tools.values()]


def tool_schema(tool: Tool) -> dict[str, Any]:
    """`tool` in the OpenAI function format chat templates render (Qwen's included)."""
    return {"type": "function",
            "function": {"name": tool.name, "description": tool.description, "parameters": dict(tool.parameters)}}


def response_messages(outcomes: Sequence[ToolOutcome]) -> list[dict[str, str]]:
    """The outcomes as `tool` chat messages, in call order."""
    return [{"role": "tool", "name": outcome.call.name or "", "content": outcome.response} for outcome in outcomes]
