"""The multi-turn rewards: `calculator_call`'s partial credit, point by point, and `environment`."""

import pytest

from grpo_core.contracts import CompletionText, ConversationText
from grpo_runner_gsm8k.tasks.tool_rewards import (CalculatorCallOptions, EnvironmentRewardOptions, calculator_call_reward,
                                            environment_reward)

FIXED = '{"name": "calculator", "arguments": {"expression": "'
RESPONSE = "<|im_end|>\n<|im_start|>tool\n408<|im_end|>\n<|im_start|>assistant\n"


def points(conversation: str, answer: str = "408") -> float:
    reward = calculator_call_reward(CalculatorCallOptions())
    return reward([ConversationText("", 1, 1, True, conversation=conversation)], [answer])[0] * 11


@pytest.mark.parametrize("conversation, expected", [
    ("no call", 0),
    ("<tool_call>", 1 + 1),  # opened, from the start
    ("x<tool_call>", 1 + 0),  # opened, not at the start
    ("<tool_call></tool_call>", 2 + 1),  # closed after the opening
    (f"<tool_call>z{FIXED}12*34z\"}}}}z</tool_call>", 5 + 1),  # every part, junk between
    (f"<tool_call>\n{FIXED}12*34\"}}}}</tool_call>", 5 + 5),  # exact, the answer not seen
    (f"<tool_call>\n{FIXED}12*34\"}}}}\n</tool_call>{RESPONSE}It is 408.", 5 + 5 + 1),
    (f"<tool_call>{FIXED}1\"}}}}</tool_call>{RESPONSE.replace('408', '1')}408", 5 + 5),  # 408 not from a tool
    (f"<tool_call>{FIXED}{FIXED}\"}}}}</tool_call>", 3 + 2),  # no digit: no expression (the fixed text has spaces)
    # only the first turn is graded: an error's digits and a second call do not complete an empty call
    (f"<tool_call>{FIXED}\"}}}}</tool_call>{RESPONSE.replace('408', 'Error: at character 54')}<tool_call>{FIXED}1\"}}}}"
     "</tool_call>", 3 + 2),
])
def test_calculator_call_points(conversation, expected):
    assert points(conversation) == pytest.approx(expected)


def test_the_answer_must_be_a_whole_number_of_the_response():
    exact = f"<tool_call>{FIXED}2*204\"}}}}</tool_call>"
    assert points(exact + RESPONSE.replace("408", "4080")) == pytest.approx(10)


def test_environment_reward_reads_the_episode_and_refuses_plain_completions():
    reward = environment_reward(EnvironmentRewardOptions(key="solved"))
    rows = [ConversationText("7", 1, 4, True, environment={"solved": 1.0}), ConversationText("3", 1, 4, True)]
    assert reward(rows, ["7", "7"]) == [1.0, 0.0]
    with pytest.raises(TypeError, match="needs rollout.multi_turn.environment"):
        reward([CompletionText("7", 1, 4, True)], ["7"])
