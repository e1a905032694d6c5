"""Token in, token out with Qwen3's real tokenizer and tool-calling chat template
(../shared/data/qwen3-tokenizer; those tests skip when it is absent): the ids appended for a
host turn leave the sampled ids as they are, decode to the expected conversation, and differ
from what a naive re-render of the conversation would give. Also with the tiny runs'
character tokenizer and its plain ChatML template."""

from pathlib import Path

import pytest

from grpo_core.chat_turns import append_turn_ids
from grpo_core.tool_calls import ToolRunner, parse_tool_calls, response_messages
from grpo_core.testing import Multiply

TOKENIZER = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "qwen3-tokenizer"


@pytest.fixture(scope="module")
def qwen3():
    if not (TOKENIZER / "tokenizer.json").is_file():
        pytest.skip("needs ../shared/data/qwen3-tokenizer")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(TOKENIZER))


@pytest.fixture(scope="module")
def runner():
    runner = ToolRunner([Multiply()])
    yield runner
    runner.close()


def _rendered_ids(tokenizer, runner, messages):
    """A conversation rendered by the template and tokenized, as the runner tokenizes prompts."""
    text = tokenizer.apply_chat_template(messages, tools=runner.offered(), add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def _prompt_ids(tokenizer, runner, question):
    return _rendered_ids(tokenizer, runner, [{"role": "user", "content": question}])


def _sampled(tokenizer, text):
    """Ids as a policy would have sampled them: the turn's text, then its stop token."""
    return tokenizer.encode(text, add_special_tokens=False) + [tokenizer.convert_tokens_to_ids("<|im_end|>")]


# The model's own spacing: compact JSON, which the template would re-render with spaces.
TURN_1 = '<think>\nI need 123 * 456.\n</think>\n\n<tool_call>\n{"name":"multiply","arguments":{"a":123,"b":456}}\n</tool_call>'


def test_a_tool_turn_is_appended_after_the_sampled_ids(qwen3, runner):
    prompt = _prompt_ids(qwen3, runner, "What is 123 * 456?")
    sampled = _sampled(qwen3, TURN_1)
    outcomes = runner.run(parse_tool_calls(qwen3.decode(sampled)))
    assert [outcome.response for outcome in outcomes] == ["56088"]
    conversation = prompt + sampled
    appended = append_turn_ids(qwen3, conversation, response_messages(outcomes), tools=runner.offered())
    assert qwen3.decode(conversation + appended) == (
        qwen3.decode(prompt) + TURN_1 + "<|im_end|>\n<|im_start|>user\n<tool_response>\n56088\n"
        "</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert appended[0] != sampled[-1], "the model's own <|im_end|> is not appended twice"


def test_a_turn_ending_at_the_call_gets_its_close_appended(qwen3, runner):
    """A sampler that stops at </tool_call> (before <|im_end|>) gets the close from the template."""
    sampled = qwen3.encode(TURN_1, add_special_tokens=False)
    appended = append_turn_ids(qwen3, sampled, [{"role": "tool", "content": "56088"}], tools=runner.offered())
    assert qwen3.decode(appended).startswith("<|im_end|>\n<|im_start|>user\n<tool_response>")


def test_a_naive_re_render_would_change_the_sampled_tokens(qwen3, runner):
    """Two assistant turns around an environment's user message: the appended ids keep turn 1's
    <think> block and JSON spacing; rendering the conversation again drops and rewrites them."""
    prompt = _prompt_ids(qwen3, runner, "What is 123 * 456?")
    turn_1 = _sampled(qwen3, TURN_1)
    tool_turn = append_turn_ids(qwen3, prompt + turn_1, [{"role": "tool", "content": "56088"}], tools=runner.offered())
    turn_2 = _sampled(qwen3, "<think>\nThe tool says 56088.\n</think>\n\n56088")
    feedback = append_turn_ids(qwen3, prompt + turn_1 + tool_turn + turn_2,
                               [{"role": "user", "content": "Now halve it."}], tools=runner.offered())
    ours = prompt + turn_1 + tool_turn + turn_2 + feedback
    assert ours[: len(prompt) + len(turn_1)] == prompt + turn_1
    messages = [{"role": "user", "content": "What is 123 * 456?"},
                {"role": "assistant", "content": qwen3.decode(turn_1[:-1])},
                {"role": "tool", "content": "56088"},
                {"role": "assistant", "content": qwen3.decode(turn_2[:-1])},
                {"role": "user", "content": "Now halve it."}]
    naive = _rendered_ids(qwen3, runner, messages)
    text = qwen3.decode(ours)
    assert "I need 123 * 456." in text and "The tool says 56088." in text
    assert "I need 123 * 456." not in qwen3.decode(naive)  # the template dropped turn 1's reasoning
    assert naive[: len(prompt) + len(turn_1)] != prompt + turn_1
    assert qwen3.decode(naive).replace("\n", "") != text.replace("\n", "")


def test_an_environment_message_with_thinking_off(qwen3):
    appended = append_turn_ids(qwen3, _sampled(qwen3, "42"), [{"role": "user", "content": "Lower."}],
                               template_kwargs={"enable_thinking": False})
    assert qwen3.decode(appended) == "\n<|im_start|>user\nLower.<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


def test_nothing_to_append_is_an_error(qwen3):
    with pytest.raises(ValueError, match="needs at least one message"):
        append_turn_ids(qwen3, [1, 2], [])


def test_the_character_tokenizer_s_chatml_appends_a_tool_turn():
    from grpo_core.tokenizer import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    sampled = tokenizer.encode('<tool_call>{"name": "multiply"}</tool_call>', add_special_tokens=False)
    for ending in ([], [tokenizer.convert_tokens_to_ids("<|im_end|>")]):
        appended = append_turn_ids(tokenizer, sampled + ending, [{"role": "tool", "content": "56088"}])
        assert tokenizer.decode(sampled + ending + appended, skip_special_tokens=False).endswith(
            "</tool_call><|im_end|>\n<|im_start|>tool\n56088<|im_end|>\n<|im_start|>assistant\n")
