"""Tool and environment text rendered by the chat template and tokenized as plain text.

A tool's output or an environment's message is text the run does not control: a web page or
a program can print `<|im_end|>\\n<|im_start|>assistant\\n...`. Tokenized as the template's
markers are (added tokens parsed), that text would become the real control ids: it could
close the tool turn and open an assistant turn the model then conditions on as its own. So
each such string is rendered as a unique placeholder, put back into the template's text with
its span remembered, and no added token (special or not: Qwen's `<tool_call>`,
`</tool_response>` and `<think>` are not "special") is taken from inside a span. Only the
markers the template itself writes around the text stay control ids.

`split_special_tokens=True` is not enough: it splits only the special added tokens, and
`</tool_response>` would stay one control id. Text with no added token in it is tokenized
exactly as before: the ids of the whole rendering are kept unless an added token was found
inside a span, and then only the text between two of the template's markers that holds one
is tokenized again, as one piece, by the same normalizer, pre-tokenizer and model without the
added tokens.
"""

from __future__ import annotations

import uuid
from typing import Any, Mapping, Sequence

Span = tuple[int, int]


def _placeholder(nonce: str, index: int) -> str:
    # Letters and digits only: a template's filters leave it as it is, and no added token matches it.
    return f"hosttext{nonce}n{index}x"


def _with_placeholders(messages: Sequence[Mapping[str, Any]], nonce: str) -> tuple[list[dict], dict[str, str]]:
    """The messages with every string but the role replaced by a placeholder; placeholder -> string."""
    replaced, strings = [], {}
    for message in messages:
        message = dict(message)
        for key, value in message.items():
            if key != "role" and isinstance(value, str):
                name = _placeholder(nonce, len(strings))
                strings[name] = value
                message[key] = name
        replaced.append(message)
    return replaced, strings


def _substituted(template_text: str, strings: Mapping[str, str]) -> tuple[str, list[Span]]:
    """`template_text` with each placeholder's string put back, and the strings' spans in it."""
    found = sorted((template_text.index(name), name) for name in strings if name in template_text)
    text, spans, at, length = [], [], 0, 0
    for position, name in found:
        before, string = template_text[at:position], strings[name]
        text += [before, string]
        spans.append((length + len(before), length + len(before) + len(string)))
        length += len(before) + len(string)
        at = position + len(name)
        if name in template_text[at:]:
            raise ValueError("the chat template renders a message's text twice; it cannot be tokenized as plain text")
    text.append(template_text[at:])
    return "".join(text), spans


def render_host_text(tokenizer: Any, trusted: Sequence[Mapping[str, Any]], host: Sequence[Mapping[str, Any]],
                     **template_kwargs: Any) -> tuple[str, list[Span]]:
    """The chat template's text of `trusted` then `host` messages (tools' and environments'),
    and the spans of the host messages' strings in it."""
    nonce = uuid.uuid4().hex
    replaced, strings = _with_placeholders(host, nonce)
    template_text = tokenizer.apply_chat_template([*map(dict, trusted), *replaced], tokenize=False, **template_kwargs)
    contents = [name for message in replaced for key, name in message.items() if key == "content" and name in strings]
    if any(name not in template_text for name in contents):
        raise ValueError("the chat template does not render a tool or environment message's content verbatim; "
                         "it cannot be tokenized as plain text")
    return _substituted(template_text, strings)


def shifted(spans: Sequence[Span], start: int) -> list[Span]:
    """The spans in the text from `start` on (those before it dropped, one across it cut)."""
    return [(max(a, start) - start, b - start) for a, b in spans if b > start]


def _inside(offset: Sequence[int], spans: Sequence[Span]) -> bool:
    start, end = offset
    return any(start < b and a < end for a, b in spans)


def found_outside(text: str, needle: str, spans: Sequence[Span]) -> list[int]:
    """Where `needle` occurs in `text` outside `spans` (a tool's output may hold it too)."""
    found, at = [], text.find(needle)
    while at >= 0:
        if not _inside((at, at + len(needle)), spans):
            found.append(at)
        at = text.find(needle, at + 1)
    return found


def _plain_backend(tokenizer: Any) -> Any:
    """The tokenizer's `tokenizers` pipeline (normalizer, pre-tokenizer, model: the same objects,
    shared) with no added tokens: text in, sub-word ids out."""
    backend = tokenizer.backend_tokenizer
    plain = type(backend)(backend.model)
    for stage in ("normalizer", "pre_tokenizer"):
        if getattr(backend, stage) is not None:
            setattr(plain, stage, getattr(backend, stage))
    return plain


def _plain_ids(tokenizer: Any, text: str, markers: set[int]) -> list[int]:
    ids = _plain_backend(tokenizer).encode(text, add_special_tokens=False).ids
    if markers.intersection(ids):
        raise ValueError(f"{type(tokenizer).__name__} gives control tokens for {text!r} even without its added "
                         "tokens; tool and environment text cannot be tokenized as plain text with it")
    return list(ids)


def encode_host_text(tokenizer: Any, text: str, spans: Sequence[Span]) -> list[int]:
    """Ids of `text` (a chat template's rendering) in which no added token comes from inside
    `spans` (tool and environment text); the template's own markers outside them stay control ids."""
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = list(encoding["input_ids"]), encoding["offset_mapping"]
    markers = set(tokenizer.added_tokens_decoder)
    if not any(i in markers and _inside(offset, spans) for i, offset in zip(ids, offsets)):
        return ids  # nothing forged: the ids of the rendering as they are
    result, run, run_start, forged = [], [], 0, False
    for i, (start, end) in zip(ids, offsets):
        if i in markers and not _inside((start, end), spans):  # one of the template's own markers
            result += _plain_ids(tokenizer, text[run_start:start], markers) if forged else run
            result.append(i)
            run, run_start, forged = [], end, False
        else:
            run.append(i)
            forged = forged or i in markers
    return result + (_plain_ids(tokenizer, text[run_start:], markers) if forged else run)
