"""Graders by name, for the `dataset` task (`task.options.grader`) and the rewards of the same
name: each turns (completions, references) into `Graded` verdicts.

| name   | right when                                                                      |
| math   | the last `\\boxed{}` equals the reference by math-verify (`grading.grade_boxed`) |
| number | the final number (`answers.extract_answer`) equals the reference's number       |
| exact  | the final answer (last `\\boxed{}`, else last non-empty line) equals the text    |
| choice | the last standalone option letter (A-J) is the reference's letter              |
| code   | the program passes the reference's tests in the sandbox (`code_grading`)        |

Graders are a plugin kind (`grpo_graders`, `GraderSpec`): these five register through the
runner's entry point like any plugin's, and `make_grader` picks any registered one by name.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from grpo_core import GraderSpec, RewardSpec
from grpo_core.config import setting
from grpo_core.config_io import plugin_options
from grpo_core.contracts import RewardFn
from grpo_core.registry import Registry, default_registry

from grpo_runner_gsm8k.tasks.answers import extract_answer, last_boxed, last_boxed_or_line, parse_number
from grpo_runner_gsm8k.tasks.code_grading import CodeGrader, CodeOptions
from grpo_runner_gsm8k.tasks.grading import Graded, TimedVerifier, grade_boxed
from grpo_runner_gsm8k.tasks.rewards import check_pairs

GradeMany = Callable[[Sequence[str], Sequence[str]], list[Graded]]
_SPACES = re.compile(r"\s+")
_CHOICE = re.compile(r"(?<![A-Za-z])\(?([A-J])\)?(?![A-Za-z])")


def final_text(completion: str) -> str | None:
    """The last `\\boxed{}`'s content, else the last non-empty line; spacing collapsed, a final period dropped."""
    span = last_boxed_or_line(completion)
    if span is None:
        return None
    text = _SPACES.sub(" ", span).strip().rstrip(".").strip()
    return text or None


def grade_exact(completion: str, reference: str) -> Graded:
    answer = final_text(completion)
    return Graded(answer, answer is not None and answer == _SPACES.sub(" ", reference).strip().rstrip("."))


def choice_of(completion: str) -> str | None:
    """The last option letter standing alone ('B', '(B)', 'answer: B', '\\boxed{B}')."""
    span = last_boxed(completion)
    letters = _CHOICE.findall(span if span is not None else completion)
    return letters[-1] if letters else None


def grade_choice(completion: str, reference: str) -> Graded:
    letter = choice_of(completion)
    return Graded(letter, letter is not None and letter == reference.strip().strip("()").upper())


def grade_number(completion: str, reference: str) -> Graded:
    answer, expected = extract_answer(completion), parse_number(reference)
    if expected is None:
        raise ValueError(f"reference {reference!r} is not a number; use the math or exact grader for it")
    return Graded(None if answer is None else str(answer), answer is not None and answer == expected)


def _one_by_one(grade: Callable[[str, str], Graded]) -> GradeMany:
    return lambda completions, references: [grade(c, r) for c, r in zip(completions, references)]


@dataclass(frozen=True)
class MathGraderOptions:
    """Options of the `math` grader."""

    timeout_s: float = setting(5.0, "Wall-clock limit of one math-verify comparison (over it: wrong).", gt=0)


@dataclass(frozen=True)
class NoGraderOptions:
    """The `number`, `exact` and `choice` graders have no options."""


def _math(options: MathGraderOptions) -> GradeMany:
    verifier = TimedVerifier(options.timeout_s)
    return _one_by_one(lambda completion, reference: grade_boxed(verifier, completion, reference))


def _code(options: CodeOptions) -> GradeMany:
    grader = CodeGrader(options)

    def grade_many(completions: Sequence[str], references: Sequence[str]) -> list[Graded]:
        verdicts = grader.grade_many(completions, references)
        return [Graded(v.program.strip() or None, v.reward(options.score) == 1.0) for v in verdicts]

    return grade_many


GRADER_SPECS = [
    GraderSpec("math", _math, MathGraderOptions, "the last \\boxed{} equals the reference by math-verify"),
    GraderSpec("number", lambda options: _one_by_one(grade_number), NoGraderOptions,
               "the final number equals the reference's number"),
    GraderSpec("exact", lambda options: _one_by_one(grade_exact), NoGraderOptions,
               "the final answer (last \\boxed{}, else last line) is the reference text"),
    GraderSpec("choice", lambda options: _one_by_one(grade_choice), NoGraderOptions,
               "the last standalone option letter (A-J) is the reference letter"),
    GraderSpec("code", _code, CodeOptions, "the program passes the reference's tests in the sandbox"),
]
_registry: Optional[Registry] = None


def use_graders_of(registry: Registry) -> None:
    """Graders are looked up in `registry` (the run's, which may hold inline plugins) from now on."""
    global _registry
    _registry = registry


def _checked(name: str, grade_many: Callable) -> GradeMany:
    """A plugin's grader whose pairs become `Graded`, one per completion."""
    def checked(completions: Sequence[str], references: Sequence[str]) -> list[Graded]:
        pairs = list(grade_many(list(completions), list(references)))
        if len(pairs) != len(completions):
            raise ValueError(f"grader {name!r} returned {len(pairs)} verdicts for {len(completions)} completions")
        return [Graded(answer, bool(correct)) for answer, correct in pairs]

    return checked


def make_grader(name: str, options: Any = None, where: str = "task.options.grader_options") -> GradeMany:
    """The registered grader `name`, built from `options` (its options dataclass, or a mapping
    checked against it; None: its defaults). An unknown name is a PluginError listing the graders."""
    spec = (_registry or default_registry()).get("grader", name)
    if not isinstance(options, spec.options):
        options = plugin_options(spec.options, options or {}, where)
    return _checked(name, spec.factory(options))


@dataclass(frozen=True)
class TextGraderOptions:
    """The `exact` and `choice` rewards have no options."""


def _reward_of(grade_many: GradeMany) -> RewardFn:
    def reward(completions: list[str], answers: list[str]) -> list[float]:
        check_pairs(completions, answers)
        return [float(g.correct) for g in grade_many(completions, answers)]

    return reward


def code_reward(options: CodeOptions) -> RewardFn:
    """`fn(completions, answers)` -> each program's test score; `fn.take_metrics()` gives the
    programs by outcome, tests and grading seconds summed since it was last called (the loop
    logs them with each step)."""
    grader = CodeGrader(options)
    totals: Counter = Counter()

    def code(completions: list[str], answers: list[str]) -> list[float]:
        check_pairs(completions, answers)
        verdicts = grader.grade_many(completions, answers)
        totals.update(grader.last_metrics)
        return [v.reward(options.score) for v in verdicts]

    def take_metrics() -> dict[str, float]:
        taken = dict(totals)
        totals.clear()
        return taken

    code.take_metrics = take_metrics
    return code


GRADER_REWARD_SPECS = [
    RewardSpec("code", code_reward, CodeOptions,
               "the program's tests run in the sandbox: 1 when all pass (or the share passed, score: fraction)"),
    RewardSpec("exact", lambda options: _reward_of(_one_by_one(grade_exact)), TextGraderOptions,
               "1 when the final answer (last \\boxed{}, else last line) is the reference text"),
    RewardSpec("choice", lambda options: _reward_of(_one_by_one(grade_choice)), TextGraderOptions,
               "1 when the last standalone option letter (A-J) is the reference letter"),
]
