"""The built-in reward functions (`correctness`, `format`), each a `grpo_core.contracts.RewardFn`:
`fn(completions: list[str], answers: list[str]) -> list[float]`, where `answers` holds the
task's reference final answers (for GSM8K the text after `####`, e.g. "72"). How a final
answer is read is in `answers`; how the run calls them safely is in `scoring`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Literal, Sequence

from grpo_core import RewardSpec
from grpo_core.config import setting
from grpo_core.contracts import RewardFn

from grpo_runner_gsm8k.answers import CorrectnessOptions, LatexChecker, is_correct, last_boxed


def correctness_reward(options: CorrectnessOptions) -> RewardFn:
    """`fn(completions, answers)` -> 1.0 where the completion's answer equals the reference."""

    def correctness(completions: list[str], answers: list[str]) -> list[float]:
        check_pairs(completions, answers)
        latex = LatexChecker(options)  # one time budget per call
        return [float(is_correct(c, a, options.fallback, latex)) for c, a in zip(completions, answers)]

    return correctness


_NUMBER_LINE = re.compile(r"[-\u2212]?\s*\$?\s*(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)?(?:\.\d+)?(?:\s*/\s*\d+)?\s*\.?")


def _is_number_text(text: str) -> bool:
    text = text.strip()
    return bool(text) and any(ch.isdigit() for ch in text) and _NUMBER_LINE.fullmatch(text) is not None


def _last_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""


def _hashes_format(text: str) -> bool:
    line = _last_line(text)
    return line.startswith("####") and _is_number_text(line[4:])


def _boxed_format(text: str) -> bool:
    content = last_boxed(_last_line(text))
    return content is not None and bool(content.strip())


FORMAT_CHECKS: dict[str, Callable[[str], bool]] = {
    "hashes": _hashes_format,
    "boxed": _boxed_format,
    "number_only": _is_number_text,
}


@dataclass(frozen=True)
class FormatOptions:
    """Options of the `format` reward (1.0 when the completion ends in the asked-for form)."""

    style: Literal["hashes", "boxed", "number_only"] = setting(
        "hashes", "hashes = the last non-empty line is '#### <number>' (what the gsm8k task asks for); "
        "boxed = the last non-empty line holds a non-empty \\boxed{...}; "
        "number_only = the whole completion is one number.")


def format_reward(options: FormatOptions) -> RewardFn:
    """`fn(completions, answers)` -> 1.0 where the completion follows `options.style`."""
    check = FORMAT_CHECKS[options.style]

    def answer_format(completions: list[str], answers: list[str]) -> list[float]:
        check_pairs(completions, answers)
        return [float(check(c)) for c in completions]

    return answer_format


def check_pairs(completions: Sequence[str], answers: Sequence[str]) -> None:
    if len(completions) != len(answers):
        raise ValueError(f"got {len(completions)} completions but {len(answers)} answers; "
                         f"pass one reference answer per completion (repeat each answer K times)")


REWARD_SPECS = [
    RewardSpec("correctness", correctness_reward, CorrectnessOptions,
               "1 when the final answer (####, \\boxed, 'answer is', ...) equals the reference"),
    RewardSpec("format", format_reward, FormatOptions,
               "1 when the completion ends in the configured answer format"),
]
