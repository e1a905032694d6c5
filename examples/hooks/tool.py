"""A `grpo_tools` plugin: count a letter in a word (offered to a multi-turn rollout as
`letter_count`); a `grpo_core.contracts.Tool`."""

from dataclasses import dataclass
from grpo_core import ToolSpec, hookimpl

@dataclass(frozen=True)
class Options:
    case_sensitive: bool = False

class LetterCount:
    name = "letter_count"
    description = "Count how many times a letter occurs in a word."
    parameters = {
        "type": "object",
        "properties": {"word": {"type": "string"}, "letter": {"type": "string", "description": "one character"}},
        "required": ["word", "letter"],
    }

    def __init__(self, options):
        self.options = options

    def __call__(self, arguments):
        word, letter = arguments["word"], arguments["letter"]
        if len(letter) != 1:
            raise ValueError(f"letter must be one character, got {letter!r}")
        if not self.options.case_sensitive:
            word, letter = word.lower(), letter.lower()
        return str(word.count(letter))

@hookimpl
def grpo_tools():
    return [ToolSpec("letter_count", LetterCount, Options, "Count a letter in a word")]
