"""The `countdown` task: reach a target from a few numbers with + - * / and parentheses.

Problem `i` of a stream is built from a generator seeded by (seed, stream, i): numbers
drawn from 1..max_number, and a target made by combining a random subset of them, so
every problem has a solution. The reference answer carries the target and the numbers
("24 from 3,5,7,2"). A completion's expression (its last `\\boxed{}`, else its last
line; the left side of an `=`) is parsed by a small recursive-descent parser, never by
`eval`, with exact fractions; it is right when it uses each given number at most once
and equals the target. Its answer (what maj@k votes on) is the value a valid expression
reaches, not its text.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from fractions import Fraction

import numpy as np
from grpo_core.config import setting
from grpo_core.contracts import Example
from grpo_core.errors import UserError

from grpo_runner_gsm8k.tasks.answers import last_boxed_or_line
from grpo_runner_gsm8k.tasks.grading import Graded
from grpo_runner_gsm8k.tasks.base import TRAIN_STREAM, GeneratedTask, check_template

MAX_DRAWS = 1000  # redraws allowed to find a target within range
MAX_EXPRESSION_CHARS = 200  # bounds the parser's recursion on runaway generations
DEFAULT_TEMPLATE = ("Using the numbers {numbers}, write an arithmetic expression that equals {target}. "
                    "Use +, -, *, / and parentheses, and each number at most once. "
                    "Put the expression, e.g. (3 + 5) * 2, in \\boxed{{}}.")


@dataclass(frozen=True)
class CountdownOptions:
    """Options of the `countdown` task."""

    count: int = setting(4, "Numbers given per problem.", ge=2, le=6)
    max_number: int = setting(20, "Numbers are drawn from 1 .. max_number.", ge=2, le=1000)
    max_target: int = setting(100, "Targets are whole numbers in 1 .. max_target.", ge=1)
    template: str = setting(DEFAULT_TEMPLATE, "Question text; {numbers} and {target} are filled in.")
    test_size: int = setting(256, "Problems in the test split (a stream separate from training).", ge=1)
    use_chat_template: bool = setting(True, "Render prompts with the tokenizer's chat template.")

    def __post_init__(self):
        check_template("template", self.template, ("numbers", "target"), required=("numbers", "target"))


def encode_answer(target: int, numbers: list[int]) -> str:
    return f"{target} from {','.join(map(str, numbers))}"


def decode_answer(answer: str) -> tuple[int, list[int]]:
    target, _, numbers = answer.partition(" from ")
    if not numbers:
        raise ValueError(f"countdown answer {answer!r} is not '<target> from <n1>,<n2>,...'; "
                         "use the countdown task's answers with the countdown reward")
    return int(target), [int(n) for n in numbers.split(",")]


def _combine(rng: np.random.Generator, numbers: list[int]) -> Fraction:
    """A random subset of `numbers` (at least two) joined left to right by random operators."""
    picked = rng.permutation(len(numbers))[:int(rng.integers(2, len(numbers) + 1))]
    value = Fraction(numbers[picked[0]])
    for index in picked[1:]:
        operator, number = "+-*/"[int(rng.integers(4))], numbers[index]
        value = {"+": value + number, "-": value - number, "*": value * number, "/": value / number}[operator]
    return value


def make_problem(options: CountdownOptions, seed: int, stream: int, index: int) -> Example:
    """Problem `index` of `stream`: the same inputs always give the same problem."""
    rng = np.random.default_rng([seed, stream, index])
    for _ in range(MAX_DRAWS):
        numbers = rng.integers(1, options.max_number + 1, size=options.count).tolist()
        target = _combine(rng, numbers)
        if target.denominator == 1 and 1 <= target <= options.max_target:
            break
    else:
        # a user error, whenever it happens: these options (nearly) never give a whole target in range
        raise UserError(f"countdown task options give no whole target in 1..{options.max_target} in {MAX_DRAWS} "
                        f"draws of {options.count} numbers up to {options.max_number}; raise task.options.max_target "
                        "or lower task.options.max_number")
    question = options.template.format(numbers=", ".join(map(str, numbers)), target=int(target))
    split = "train" if stream == TRAIN_STREAM else "test"
    return Example(question, encode_answer(int(target), numbers), f"countdown/{split}/{index}")


# ---------------------------------------------------------------- checking an expression

_TOKEN = re.compile(r"\s*(\d+|[-+*/()])")
_SYNONYMS = {"\\times": "*", "\\cdot": "*", "\\div": "/", "×": "*", "÷": "/", "−": "-", "\\left": "", "\\right": ""}


class _Parser:
    """expression := term (('+'|'-') term)*; term := factor (('*'|'/') factor)*;
    factor := integer | '(' expression ')'. No unary minus: numbers are used as given."""

    def __init__(self, text: str):
        self.tokens, position = [], 0
        while position < len(text.rstrip()):
            match = _TOKEN.match(text, position)
            if match is None:
                raise ValueError(f"unexpected {text[position:position + 10]!r}")
            self.tokens.append(match.group(1))
            position = match.end()
        self.position, self.numbers = 0, []

    def _next(self) -> str | None:
        return self.tokens[self.position] if self.position < len(self.tokens) else None

    def parse(self) -> Fraction:
        value = self._expression()
        if self._next() is not None:
            raise ValueError(f"unexpected {self._next()!r}")
        return value

    def _expression(self) -> Fraction:
        value = self._term()
        while self._next() in ("+", "-"):
            self.position += 1
            value = value + self._term() if self.tokens[self.position - 1] == "+" else value - self._term()
        return value

    def _term(self) -> Fraction:
        value = self._factor()
        while self._next() in ("*", "/"):
            self.position += 1
            operator, right = self.tokens[self.position - 1], self._factor()
            value = value * right if operator == "*" else value / right  # ZeroDivisionError: invalid
        return value

    def _factor(self) -> Fraction:
        token = self._next()
        self.position += 1
        if token == "(":
            value = self._expression()
            if self._next() != ")":
                raise ValueError("unclosed '('")
            self.position += 1
            return value
        if token is None or not token.isdigit():
            raise ValueError(f"expected a number, got {token!r}")
        self.numbers.append(int(token))
        return Fraction(int(token))


def evaluate_expression(expression: str) -> tuple[Fraction, list[int]]:
    """The exact value of an arithmetic expression and the numbers it uses, in order;
    ValueError (or ZeroDivisionError) when it is not one."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression of {len(expression)} characters is too long")
    for synonym, operator in _SYNONYMS.items():
        expression = expression.replace(synonym, operator)
    parser = _Parser(expression)
    return parser.parse(), parser.numbers


def completion_expression(completion: str) -> str | None:
    """The expression a completion answers with: its last `\\boxed{}`, else its last line;
    only the left side of an `=`."""
    span = last_boxed_or_line(completion)
    if span is None:
        return None
    return span.split("=")[0].strip().strip("$").strip() or None


def check_countdown(completion: str, answer: str) -> Graded:
    """Whether the completion's expression uses each given number at most once and equals the
    target. The answer is the expression's canonical answer: the exact value it reaches ("5",
    "7/2") when it is valid (it parses and uses only the given numbers, each at most once), so
    `2+3` and `3+2` are one answer in a majority vote; None when it is not valid."""
    target, numbers = decode_answer(answer)
    expression = completion_expression(completion)
    if expression is None:
        return Graded(None, False)
    try:
        value, used = evaluate_expression(expression)
    except (ValueError, ZeroDivisionError):
        return Graded(None, False)
    if Counter(used) - Counter(numbers):  # a number not given, or one used twice: no answer to vote for
        return Graded(None, False)
    return Graded(str(value), value == target)


class CountdownTask(GeneratedTask):
    """Generated countdown problems (see `GeneratedTask`), graded by `check_countdown`."""

    name = "countdown"
    make_problem = staticmethod(make_problem)

    def grade(self, completion: str, reference: str) -> Graded:
        return check_countdown(completion, reference)
