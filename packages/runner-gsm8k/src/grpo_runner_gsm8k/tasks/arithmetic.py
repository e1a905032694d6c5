"""The `arithmetic` task: generated problems such as "3+5=" -> "8", no download.

Problem `i` of a stream is drawn from a generator seeded by (seed, stream, i),
so any problem can be rebuilt from its index: the order is deterministic,
resuming is exact, and processes draw disjoint indices. The defaults (two
single-digit operands, addition, a 4-character prompt) are meant to be
learnable from scratch by a tiny model with a character tokenizer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
from grpo_core.config import setting
from grpo_core.contracts import Example
from grpo_core.errors import UserError

from grpo_runner_gsm8k.tasks.base import TRAIN_STREAM, GeneratedTask, check_template

OPERATIONS = "+-*"
MAX_DRAWS = 10_000  # redraws allowed to find a result within the configured range


@dataclass(frozen=True)
class ArithmeticOptions:
    """Options of the `arithmetic` task (difficulty = digits, operations, operands)."""

    digits: int = setting(1, "Each operand is drawn uniformly from 0 .. 10**digits - 1.", ge=1, le=9)
    operations: str = setting("+", "Operators to draw from, any of '+', '-', '*' (e.g. '+-').")
    operands: int = setting(2, "Numbers per problem.", ge=2, le=8)
    allow_negative: bool = setting(
        False, "Allow negative results; false redraws problems whose result is below 0.")
    max_result: Optional[int] = setting(
        None, "Redraw problems whose result is above this; 9 keeps every answer one character "
        "(the easiest setting for a from-scratch model). Null: no limit.", ge=0)
    template: str = setting(
        "{expression}=", "Question text; {expression} becomes e.g. '3+5'. Short prompts keep "
        "character-level models fast; 'What is {expression}?' reads better for chat models.")
    spaces: bool = setting(False, "Write '3 + 5' instead of '3+5'.")
    instruction: str = setting(
        "", "Appended to the question after a space, e.g. 'Answer as #### <number>.'; empty for none.")
    test_size: int = setting(256, "Problems in the test split (a stream separate from training).", ge=1)
    use_chat_template: bool = setting(
        False, "Render prompts with the tokenizer's chat template (false: the raw question).")

    def __post_init__(self):
        _check(self)


def _check(options: ArithmeticOptions) -> None:
    unknown = sorted(set(options.operations) - set(OPERATIONS))
    if not options.operations or unknown:
        raise ValueError(f"arithmetic operations {options.operations!r} must be a non-empty string of "
                         f"'+', '-', '*' (unknown: {unknown})")
    check_template("template", options.template, ("expression",), required=("expression",))


def evaluate(numbers: list[int], operators: list[str]) -> int:
    """Value of `numbers[0] op0 numbers[1] op1 ...` with `*` before `+`/`-`."""
    total, sign, term = 0, 1, numbers[0]
    for operator, number in zip(operators, numbers[1:]):
        if operator == "*":
            term *= number
        else:
            total, sign, term = total + sign * term, (1 if operator == "+" else -1), number
    return total + sign * term


def _draw(rng: np.random.Generator, options: ArithmeticOptions) -> tuple[list[int], list[str], int]:
    numbers = rng.integers(0, 10 ** options.digits, size=options.operands).tolist()
    operators = rng.choice(list(options.operations), size=options.operands - 1).tolist()
    return numbers, operators, evaluate(numbers, operators)


def _in_range(result: int, options: ArithmeticOptions) -> bool:
    if result < 0 and not options.allow_negative:
        return False
    return options.max_result is None or result <= options.max_result


def make_problem(options: ArithmeticOptions, seed: int, stream: int, index: int) -> Example:
    """Problem `index` of `stream`: the same inputs always give the same problem."""
    rng = np.random.default_rng([seed, stream, index])
    for _ in range(MAX_DRAWS):
        numbers, operators, result = _draw(rng, options)
        if _in_range(result, options):
            break
    else:
        # a user error, whenever it happens: these options (nearly) never give a result in range
        raise UserError(f"arithmetic task options give no problem with a result in range (allow_negative="
                        f"{options.allow_negative}, max_result={options.max_result}) in {MAX_DRAWS} draws of "
                        f"operations={options.operations!r}, operands={options.operands}, digits={options.digits}; "
                        "raise task.options.max_result, set task.options.allow_negative=true or use fewer digits")
    joiner = " {} " if options.spaces else "{}"
    expression = str(numbers[0]) + "".join(joiner.format(op) + str(n) for op, n in zip(operators, numbers[1:]))
    question = options.template.format(expression=expression)
    question = f"{question} {options.instruction}" if options.instruction else question
    return Example(question, str(result), f"arithmetic/{'train' if stream == TRAIN_STREAM else 'test'}/{index}")


class ArithmeticTask(GeneratedTask):
    """Generated arithmetic problems (see `GeneratedTask`)."""

    name = "arithmetic"
    make_problem = staticmethod(make_problem)

    def __init__(self, options: ArithmeticOptions, *, seed: int = 0, process_index: int = 0,
                 process_count: int = 1):
        super().__init__(options, seed=seed, process_index=process_index, process_count=process_count)
