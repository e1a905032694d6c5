"""Tokenizers: HF `AutoTokenizer` for real checkpoints, and an in-process
character-level tokenizer (built with the `tokenizers` library) for tests and tiny runs.

Both are `transformers` tokenizers, so chat templates, padding and `save_pretrained`
behave the same way; rollouts left-pad, so `padding_side` defaults to "left".
"""

from __future__ import annotations

import json
import os
import string
from collections.abc import Sequence
from typing import Any

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
UNK = "<|unk|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END, UNK)
# Qwen2.5 / Qwen3 write tool calls between these; a multi-turn turn stops at the closing one.
TOOL_CALL_TOKENS = ("<tool_call>", "</tool_call>")
# The fixed text of a calculator call, one token each (as a BPE vocabulary holds it in a few):
# a tiny character-level model then writes a call in 9 tokens instead of 70 characters.
CALCULATOR_CALL_TOKENS = ('{"name": "calculator", "arguments": {"expression": "', '"}}')

# Qwen2.5-style ChatML, without the default system prompt.
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

DEFAULT_CHARS = string.digits + string.ascii_letters + string.punctuation + " \n"


# Names transformers writes for a tokenizer that is just a `tokenizers` backend.
PLAIN_TOKENIZER_CLASSES = ("PreTrainedTokenizerFast", "TokenizersBackend")


def _saved_tokenizer_class(path: str) -> str | None:
    config = os.path.join(path, "tokenizer_config.json")
    if not os.path.isfile(config):
        return None
    with open(config) as f:
        return json.load(f).get("tokenizer_class")


def load_tokenizer(path_or_hub_id: str | os.PathLike, padding_side: str = "left") -> Any:
    """`transformers.AutoTokenizer` from a local directory or a Hub id.

    A directory saved from a plain `PreTrainedTokenizerFast` (the character tokenizer)
    is loaded as such: AutoTokenizer would otherwise pick the byte-level Qwen2
    tokenizer from the model's config.json and change the vocabulary.
    """
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    path = os.fspath(path_or_hub_id)
    plain = _saved_tokenizer_class(path) in PLAIN_TOKENIZER_CLASSES
    loader = PreTrainedTokenizerFast if plain else AutoTokenizer
    try:
        tokenizer = loader.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise FileNotFoundError(f"cannot load a tokenizer from {os.fspath(path_or_hub_id)!r}: {e}") from e
    tokenizer.padding_side = padding_side
    return tokenizer


def build_char_tokenizer(
    chars: str = DEFAULT_CHARS, extra_special_tokens: Sequence[str] = (), padding_side: str = "left"
) -> Any:
    """A character-level `PreTrainedTokenizerFast` with Qwen special tokens and ChatML.

    Ids: special tokens first (<|endoftext|>=0, <|im_start|>=1, <|im_end|>=2, <|unk|>=3,
    then `extra_special_tokens`), then one id per character of `chars` in order.
    pad = <|endoftext|> and eos = <|im_end|> as in Qwen2.5-Instruct.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = [*SPECIAL_TOKENS, *extra_special_tokens]
    vocab = {tok: i for i, tok in enumerate(specials)}
    for ch in dict.fromkeys(chars):  # keeps first occurrence, drops repeats
        vocab.setdefault(ch, len(vocab))
    backend = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()  # concatenate characters, no separators
    backend.add_special_tokens(specials)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        unk_token=UNK,
        additional_special_tokens=[IM_START, *extra_special_tokens],
        chat_template=CHATML_TEMPLATE,
        padding_side=padding_side,
        model_max_length=1 << 20,
    )


def apply_chat_template(
    tokenizer: Any, messages: Sequence[dict[str, str]], add_generation_prompt: bool = True, tokenize: bool = False
) -> Any:
    """The tokenizer's own chat template applied to `messages` ([{"role", "content"}])."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"tokenizer {type(tokenizer).__name__} has no chat_template; set tokenizer.chat_template.")
    return tokenizer.apply_chat_template(list(messages), add_generation_prompt=add_generation_prompt, tokenize=tokenize)
