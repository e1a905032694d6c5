"""Rewards of multi-turn runs: `environment` gives a value of each row's environment's reward
information; `calculator_call` is a partial-credit reward for writing a calculator call and
using its answer (the tiny tool config, configs/tiny_tools.yaml).

A random model almost never writes a whole call, so an all-or-nothing reward gives a GRPO
group no variance to learn from. This one counts what a row's first turn (up to its first
`</tool_call>`, or its first `<|im_end|>`) has of a call and what the call gave, and returns
`points / 11`. The call's five parts are `<tool_call>`, the
fixed text `{"name": "calculator", "arguments": {"expression": "`, an expression (a digit, with
digits, + - * / ( ) . ^ % and spaces around it), `"}}` and `</tool_call>`:

    1-5.  each part found in order after the ones before it, anything between them (the
          closing tag counts when found after the opening one, whatever lies between);
    6-10. each part that follows the ones before it with only whitespace between, from the
          start of the completion (10: the call is exact);
    11.   a tool response holds the reference answer (the call computed the right thing).

Points 1-5 let the parts be learned side by side (a reward for the closing tag only after all
the other parts teaches the model never to close early, and then never to close at all);
points 6-10 then reward removing what lies between them, front to back. Correctness of the
final answer is the `correctness` reward's job; a config weighs the two. Only the first turn
is graded for the parts: otherwise the digits of a tool's error message and a second call
would make up for a call without an expression.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from grpo_core import RewardSpec
from grpo_core.config import setting
from grpo_core.contracts import RewardFn

from grpo_runner_gsm8k.tasks.rewards import check_pairs

# At least one digit: the fixed text's own spaces are no expression (a model wrote it twice for one).
EXPRESSION = r"[+\-*/().^% ]*[0-9][0-9+\-*/().^% ]*"
CALL_PARTS = tuple(re.compile(part) for part in (
    r"<tool_call>", r'\{"name":\s*"calculator",\s*"arguments":\s*\{"expression":\s*"', EXPRESSION,
    r'"\}\}', r"</tool_call>"))
SPACE = re.compile(r"\s*")
NEXT_ASSISTANT_TURN = "<|im_start|>assistant"
POINTS = 2 * len(CALL_PARTS) + 1


@dataclass(frozen=True)
class CalculatorCallOptions:
    """The `calculator_call` reward has no options."""


def parts_in_order(text: str) -> int:
    """Points 1-5: parts 1-4 found one after another (leftmost each), then the closing tag
    anywhere after the opening one."""
    position, found = 0, 0
    for part in CALL_PARTS[:-1]:
        match = part.search(text, position)
        if match is None:
            break
        position, found = match.end(), found + 1
    opening = CALL_PARTS[0].search(text)
    return found + (opening is not None and CALL_PARTS[-1].search(text, opening.end()) is not None)


def parts_in_a_row(text: str) -> int:
    """Points 6-10: the parts that follow one another from the start, whitespace between."""
    position = 0
    for found, part in enumerate(CALL_PARTS):
        match = part.match(text, SPACE.match(text, position).end())
        if match is None:
            return found
        position = match.end()
    return len(CALL_PARTS)


def answered_by_tool(conversation: str, answer: str) -> bool:
    """The tool turn after the first call (up to the next assistant turn, ChatML's
    `<|im_start|>assistant`) holds the answer as a whole number."""
    after_call = conversation.split("</tool_call>", 1)[1] if "</tool_call>" in conversation else ""
    tool_turn = after_call.split(NEXT_ASSISTANT_TURN, 1)[0]
    return re.search(rf"(?<![0-9.]){re.escape(answer.strip())}(?![0-9.])", tool_turn) is not None


def calculator_call_reward(options: CalculatorCallOptions) -> RewardFn:
    """`fn(completions, answers)` -> points / 11 (see the module doc); completions must be
    `grpo_core.contracts.ConversationText` (a multi-turn run's)."""
    del options

    def calculator_call(completions: list[str], answers: list[str]) -> list[float]:
        check_pairs(completions, answers)
        return [_credit(completion, answer) for completion, answer in zip(completions, answers)]

    return calculator_call


def _credit(completion: str, answer: str) -> float:
    conversation = getattr(completion, "conversation", None)
    if conversation is None:
        raise TypeError("the calculator_call reward grades whole conversations: enable rollout.multi_turn "
                        f"(got a {type(completion).__name__}, not a ConversationText)")
    turn = first_turn(conversation)
    exact = parts_in_a_row(turn)
    answered = exact == len(CALL_PARTS) and answered_by_tool(conversation, answer)
    return (parts_in_order(turn) + exact + answered) / POINTS


def first_turn(conversation: str) -> str:
    """The conversation up to its first `</tool_call>` (kept), else up to its first `<|im_end|>`."""
    if "</tool_call>" in conversation:
        return conversation.split("</tool_call>", 1)[0] + "</tool_call>"
    return conversation.split("<|im_end|>", 1)[0]


@dataclass(frozen=True)
class EnvironmentRewardOptions:
    """Options of the `environment` reward."""

    key: str = setting("reward", "The name, in the environment's reward_info(), of the value to give.")


def environment_reward(options: EnvironmentRewardOptions) -> RewardFn:
    """`fn(completions, answers)` -> each row's environment's `reward_info()[key]` at the end of
    its episode (0 when the environment gave no such value)."""

    def environment(completions: list[str], answers: list[str]) -> list[float]:
        check_pairs(completions, answers)
        infos = [getattr(completion, "environment", None) for completion in completions]
        if any(info is None for info in infos):
            raise TypeError("the environment reward needs rollout.multi_turn.environment (its completions are "
                            "grpo_core.contracts.ConversationText)")
        return [float(info.get(options.key, 0.0)) for info in infos]

    return environment


TOOL_REWARD_SPECS = [
    RewardSpec("calculator_call", calculator_call_reward, CalculatorCallOptions,
               "Partial credit for the stages of a calculator call, up to its response holding the answer"),
    RewardSpec("environment", environment_reward, EnvironmentRewardOptions,
               "The value `key` of each row's environment's reward information (rollout.multi_turn.environment)"),
]
