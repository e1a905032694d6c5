"""`calculator_call`: a partial-credit reward for writing a calculator call and using its
answer (the tiny tool config, configs/tiny_tools.yaml).

A random model almost never writes a whole call, so an all-or-nothing reward gives a GRPO
group no variance to learn from. This one counts what a row's first turn has of a call and
what the call gave, and returns `points / 7`:

    1-4. the call's first four parts, found in order, anything between them: `<tool_call>`,
         the fixed text `{"name": "calculator", "arguments": {"expression": "`, an
         expression (digits and + - * / ( ) . ^ %), `"}}`
    5.   `</tool_call>` after `<tool_call>` (with or without the parts between)
    6.   the call is exactly those parts, with only whitespace around the fixed text
    7.   a tool response holds the reference answer (the call computed the right thing)

Each part is rewarded before the call is whole, so the parts are learned side by side rather
than one after the other (a reward for the closing tag only after all the other parts would
teach the model never to close early, and then never to close at all). Correctness of the final answer is the `correctness`
reward's job; a config weighs the two.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from grpo_core import RewardSpec
from grpo_core.contracts import RewardFn

from grpo_runner_gsm8k.rewards import check_pairs

CALL_PARTS = (r"<tool_call>", r'\{"name":\s*"calculator",\s*"arguments":\s*\{"expression":\s*"',
              r"[0-9+\-*/().^% ]+", r'"\}\}', r"</tool_call>")
# Parts 1-4 count when found after all the parts before them; the closing tag when found after
# the opening one: a call closed early then still earns it, and the parts in between are
# learned as insertions into a call that already closes.
IN_ORDER = [*(re.compile(r".*?".join(CALL_PARTS[:count]), re.S) for count in range(1, len(CALL_PARTS))),
            re.compile(CALL_PARTS[0] + r".*?" + CALL_PARTS[-1], re.S)]
WHOLE_CALL = re.compile(r"\s*".join(CALL_PARTS[:2]) + "".join(CALL_PARTS[2:4]) + r"\s*" + CALL_PARTS[4])
POINTS = len(CALL_PARTS) + 2


@dataclass(frozen=True)
class CalculatorCallOptions:
    """The `calculator_call` reward has no options."""


def call_points(conversation: str) -> int:
    """Points 1-6 of the module doc: the call's parts found in order, and whether it is exact."""
    found = sum(pattern.search(conversation) is not None for pattern in IN_ORDER[:-1])
    found += IN_ORDER[-1].search(conversation) is not None
    return found + (found == len(CALL_PARTS) and WHOLE_CALL.match(conversation) is not None)


def answered_by_tool(conversation: str, answer: str) -> bool:
    """A complete call was made and the text after it holds the answer as a whole number."""
    after_call = conversation.split("</tool_call>", 1)[1] if "</tool_call>" in conversation else ""
    return re.search(rf"(?<![0-9.]){re.escape(answer.strip())}(?![0-9.])", after_call) is not None


def calculator_call_reward(options: CalculatorCallOptions) -> RewardFn:
    """`fn(completions, answers)` -> points / 7 (see the module doc); completions must be
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
    points = call_points(conversation)
    if points == len(CALL_PARTS) + 1 and answered_by_tool(conversation, answer):
        points += 1
    return points / POINTS


TOOL_REWARD_SPECS = [
    RewardSpec("calculator_call", calculator_call_reward, CalculatorCallOptions,
               "Partial credit for the stages of a calculator call, up to its response holding the answer"),
]
