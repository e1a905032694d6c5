"""Rewards of the boxed-answer math tasks and of countdown, each a `grpo_core.contracts.RewardFn`
graded exactly as evaluation grades (`grading.grade_boxed`, `tasks.countdown.check_countdown`)."""

from __future__ import annotations

from dataclasses import dataclass

from grpo_core import RewardSpec
from grpo_core.config import setting
from grpo_core.contracts import RewardFn

from grpo_runner_gsm8k.tasks.grading import TimedVerifier, grade_boxed
from grpo_runner_gsm8k.tasks.rewards import check_pairs
from grpo_runner_gsm8k.tasks.countdown import check_countdown


@dataclass(frozen=True)
class BoxedAnswerOptions:
    """Options of the `boxed_answer` reward."""

    timeout_s: float = setting(5.0, "Wall-clock limit of one math-verify comparison; past it, 0.", gt=0.0)


def boxed_answer_reward(options: BoxedAnswerOptions) -> RewardFn:
    """`fn(completions, answers)` -> 1.0 where the boxed answer is equivalent to the reference
    (`grading.grade_boxed`: every box agrees, LaTeX only inside a box)."""
    verifier = TimedVerifier(options.timeout_s)  # one worker process for the run

    def boxed_answer(completions: list[str], answers: list[str]) -> list[float]:
        check_pairs(completions, answers)
        return [float(grade_boxed(verifier, c, a).correct) for c, a in zip(completions, answers)]

    return boxed_answer


@dataclass(frozen=True)
class CountdownRewardOptions:
    """The `countdown` reward has no options."""


def countdown_reward(options: CountdownRewardOptions) -> RewardFn:
    """`fn(completions, answers)` -> 1.0 where the expression reaches the target using each number at most once."""

    def countdown(completions: list[str], answers: list[str]) -> list[float]:
        check_pairs(completions, answers)
        return [float(check_countdown(c, a).correct) for c, a in zip(completions, answers)]

    return countdown


MATH_REWARD_SPECS = [
    RewardSpec("boxed_answer", boxed_answer_reward, BoxedAnswerOptions,
               "1 when the boxed answer (all boxes agreeing) equals the reference by math-verify (time-limited)"),
    RewardSpec("countdown", countdown_reward, CountdownRewardOptions,
               "1 when the expression uses each given number at most once and equals the target"),
]
