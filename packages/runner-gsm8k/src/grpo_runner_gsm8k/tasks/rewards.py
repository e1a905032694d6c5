"""The built-in reward functions (`correctness`, `format`), each a `grpo_core.contracts.RewardFn`:
`fn(completions: list[str], answers: list[str]) -> list[float]`, where `answers` holds the
task's reference final answers (for GSM8K the text after `####`, e.g. "72"). How a final
answer is read is in `answers`; how the run calls them safely is in `scoring`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Literal, Optional, Sequence

from grpo_core import RewardSpec
from grpo_core.config import setting
from grpo_core.contracts import RewardFn

from grpo_runner_gsm8k.tasks.answers import CorrectnessOptions, LatexChecker, is_correct, last_boxed


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


@dataclass(frozen=True)
class OverlongOptions:
    """Options of the `overlong` reward: DAPO's soft overlong punishment."""

    max_length: Optional[int] = setting(
        None, "L_max in tokens; null = the rollout's budget (rollout.max_new_tokens).", ge=1)
    # 4096: DAPO's L_cache (with L_max 20480).
    buffer: int = setting(
        4096, "L_cache: the penalty rises linearly over this many tokens before L_max (at most L_max).", ge=1)


def overlong_penalty(num_tokens: int, max_length: int, buffer: int) -> float:
    """0 up to L_max - L_cache tokens, then falling linearly to -1 at L_max, -1 beyond
    (Yu et al. 2025, DAPO, eq. 13); a buffer longer than L_max is cut to it."""
    buffer = min(buffer, max_length)
    start = max_length - buffer
    if num_tokens <= start:
        return 0.0
    return max((start - num_tokens) / buffer, -1.0)


def overlong_reward(options: OverlongOptions) -> RewardFn:
    """`fn(completions, answers)` -> the soft overlong penalty of each completion's token
    count; completions must be `grpo_core.contracts.CompletionText` (the runner's are)."""

    def overlong(completions: list[str], answers: list[str]) -> list[float]:
        check_pairs(completions, answers)
        return [overlong_penalty(_token_count(c), options.max_length or c.max_tokens, options.buffer)
                for c in completions]

    return overlong


def _token_count(completion: str) -> int:
    if not hasattr(completion, "num_tokens"):
        raise TypeError("the overlong reward needs token counts: pass grpo_core.contracts.CompletionText, "
                        f"got {type(completion).__name__}")
    return completion.num_tokens


def check_pairs(completions: Sequence[str], answers: Sequence[str]) -> None:
    if len(completions) != len(answers):
        raise ValueError(f"got {len(completions)} completions but {len(answers)} answers; "
                         f"pass one reference answer per completion (repeat each answer K times)")


REWARD_SPECS = [
    RewardSpec("correctness", correctness_reward, CorrectnessOptions,
               "1 when the final answer (####, \\boxed, 'answer is', ...) equals the reference"),
    RewardSpec("format", format_reward, FormatOptions,
               "1 when the completion ends in the configured answer format"),
    RewardSpec("overlong", overlong_reward, OverlongOptions,
               "DAPO soft overlong punishment: 0, then down to -1 over the last `buffer` tokens before max_length"),
]
