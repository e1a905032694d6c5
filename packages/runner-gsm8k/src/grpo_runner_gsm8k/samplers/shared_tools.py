"""Tool calls of a multi-turn rollout run once, with the same outcomes on every process.

With several processes every process decodes the same global rows, so each parses the same
calls. If each ran them, the processes could disagree: a call past its timeout on one
process only, a tool with its own state or randomness, a clock in a response. Then they
would append different tool turns, start different rounds and feed different data into one
global batch. So process 0 alone runs the calls. Each time the turn loop collects the calls
that have returned, process 0 sends them to the others (`broadcast_object`: the response
texts, statuses and seconds), and every process appends the same tool turns and starts the
same rounds. The other processes never run a tool; while process 0 waits on one, they wait
in the broadcast. With one process nothing is sent.
"""

from __future__ import annotations

import concurrent.futures as futures
from typing import Any, Sequence

import jax

from grpo_core.tool_calls import ToolCall, ToolOutcome, ToolRunner

from grpo_runner_gsm8k.multihost import broadcast_object


def runs_tools() -> bool:
    """Whether this process runs the tool calls (process 0)."""
    return jax.process_index() == 0


def submit(runner: ToolRunner, calls: Sequence[ToolCall]) -> futures.Future | None:
    """The calls started in the background on process 0; None on the others."""
    return runner.submit(calls) if runs_tools() else None


def returned(pending: dict[Any, futures.Future | None], wait: bool) -> dict[Any, list[ToolOutcome]]:
    """The outcomes of the pending calls that have returned, by their key, the same on every
    process (`pending` holds the same keys on each). wait: first block until one has returned."""
    if not pending:
        return {}
    done: dict[Any, list[ToolOutcome]] = {}
    if runs_tools():
        if wait:
            futures.wait(list(pending.values()), return_when=futures.FIRST_COMPLETED)
        done = {key: future.result() for key, future in pending.items() if future.done()}
    return broadcast_object(done)


def all_returned(pending: Sequence[futures.Future | None]) -> list[list[ToolOutcome]]:
    """Every pending call's outcomes, in order, once all have returned; the same on every process."""
    if not pending:
        return []
    return broadcast_object([future.result() for future in pending] if runs_tools() else None)
