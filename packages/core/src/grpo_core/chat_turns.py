"""Token in, token out: the ids to append after an assistant turn for the turn that follows
it (tool responses, an environment's message), rendered by the model's own chat template.

A multi-turn row's tokens are exactly what the model sampled plus, for each host turn, the
template's tokens for it. Re-rendering the whole conversation instead would not reproduce
the sampled tokens: Qwen3's template drops the `<think>` blocks of turns before the last
user message and rewrites tool calls in its own JSON spacing, so the model would be trained
on tokens it never produced. The difference is rendered once around a placeholder assistant
turn (the template's text after the placeholder: the turn's close, the new messages and the
generation prompt) and only those tokens are appended; the ids so far are never decoded
and re-encoded. The messages' own text (a tool's output, an environment's message) never
becomes a control token (grpo_core.host_text).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from grpo_core.host_text import Span, encode_host_text, found_outside, render_host_text, shifted

PLACEHOLDER_QUESTION = "<<placeholder question>>"
PLACEHOLDER_ANSWER = "<<placeholder answer>>"


def _after_assistant(tokenizer: Any, messages: Sequence[Mapping[str, str]], *,
                     tools: Sequence[Mapping[str, Any]] | None = None,
                     template_kwargs: Mapping[str, Any] | None = None) -> tuple[str, list[Span]]:
    """The template's text from the end of an assistant turn's content through `messages` and
    the next generation prompt, and the spans of the messages' strings in it (host text)."""
    trusted = [{"role": "user", "content": PLACEHOLDER_QUESTION}, {"role": "assistant", "content": PLACEHOLDER_ANSWER}]
    text, spans = render_host_text(tokenizer, trusted, messages, tools=list(tools) if tools else None,
                                   add_generation_prompt=True, **dict(template_kwargs or {}))
    answer = found_outside(text, PLACEHOLDER_ANSWER, spans)
    if len(answer) != 1:
        raise ValueError("the chat template does not render an assistant message's content verbatim; "
                         "its turns cannot be appended token by token")
    start = answer[0] + len(PLACEHOLDER_ANSWER)
    return text[start:], shifted(spans, start)


def _already_sampled(conversation_ids: Sequence[int], suffix_ids: Sequence[int], close_length: int) -> int:
    """How many leading ids of the suffix the conversation already ends with: the model's own
    stop token (e.g. `<|im_end|>`) when it closed its turn itself."""
    for count in range(min(close_length, len(conversation_ids)), 0, -1):
        if list(conversation_ids[-count:]) == list(suffix_ids[:count]):
            return count
    return 0


def _close_length(tokenizer: Any, suffix_ids: Sequence[int]) -> int:
    """Ids of the assistant turn's close: those before the first special token that opens a turn."""
    opener = tokenizer.convert_tokens_to_ids("<|im_start|>")
    if isinstance(opener, int) and opener in suffix_ids:
        return list(suffix_ids).index(opener)
    return min(2, len(suffix_ids))


def append_turn_ids(tokenizer: Any, conversation_ids: Sequence[int], messages: Sequence[Mapping[str, str]], *,
                    tools: Sequence[Mapping[str, Any]] | None = None,
                    template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
    """The ids to append to `conversation_ids` (the prompt and everything sampled so far, the
    last turn the model's) for `messages` (e.g. `tool` responses) and the next generation
    prompt. `tools` are the template's `tools=` (as when the prompt was rendered). The
    messages' text is tokenized as plain text (grpo_core.host_text): only the template's own
    markers become control ids."""
    if not messages:
        raise ValueError("append_turn_ids needs at least one message to append; got none")
    suffix, host_spans = _after_assistant(tokenizer, messages, tools=tools, template_kwargs=template_kwargs)
    suffix_ids = encode_host_text(tokenizer, suffix, host_spans)
    skip = _already_sampled(conversation_ids, suffix_ids, _close_length(tokenizer, suffix_ids))
    return suffix_ids[skip:]


def host_conversation_ids(tokenizer: Any, messages: Sequence[Mapping[str, str]], *,
                          tools: Sequence[Mapping[str, Any]] | None = None,
                          template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
    """Ids of `messages`, all host text (an environment's opening messages), rendered by the
    template with `tools` and the generation prompt; their text tokenized as plain text."""
    text, spans = render_host_text(tokenizer, [], messages, tools=list(tools) if tools else None,
                                   add_generation_prompt=True, **dict(template_kwargs or {}))
    return encode_host_text(tokenizer, text, spans)
