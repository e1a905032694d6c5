"""The calculator: exact answers, and every hostile expression answered with an error text."""

import random

import pytest

from grpo_core.contracts import ToolError
from grpo_core.tool_calls import ToolCall, ToolRunner
from grpo_tools.calculator import MAX_CHARS, Calculator, CalculatorError, evaluate, show


@pytest.mark.parametrize("expression, expected", [
    ("1 + 2 * 3", "7"), ("(1 + 2) * 3", "9"), ("0.1 + 0.2", "0.3"), ("1 / 3", "0.333333333333333"),
    ("7 // 2", "3"), ("-7 // 2", "-4"), ("7 % 3", "1"), ("2 ** 10", "1024"), ("2 ^ 10", "1024"),
    ("-2 ** 2", "-4"), ("2 ** -2", "0.25"), ("2 ** 3 ** 2", "512"), ("--3", "3"), ("3.5e2", "350"),
    ("12345678901234567890 * 98765432109876543210", "1219326311370217952237463801111263526900"),
    ("10 ** 999 // 10 ** 998", "10"), ("4 ** 0.5", "2"),
])
def test_exact_values(expression, expected):
    assert show(evaluate(expression)) == expected


@pytest.mark.parametrize("expression, error", [
    ("1 / 0", "division by zero"), ("5 // (2 - 2)", "division by zero"), ("3 % 0", "division by zero"),
    ("0 ** -1", "division by zero"),
    ("9 ** 9 ** 9", "the result is too large (over 1000 digits)"),
    ("10 ** 600 * 10 ** 600", "the result is too large (over 1000 digits)"),
    ("1e999999", "is too large (over 1000 digits)"), ("1e300 ** 1.5 ** 9", "the result is too large"),
    ("(" * 60 + "1" + ")" * 60, "nested too deeply (over 50 levels)"), ("-" * 60 + "1", "nested too deeply"),
    ("1 +" * 200, "the expression is too long"), ("(-8) ** (1/3)", "not a real number"),
    ("", "the expression is empty"), ("2 * (3 + 4", "ends too early"), ("(1))", "unexpected ')'"),
    ("import os", "unexpected 'import os'"), ("1,000", "unexpected ',000'"), ("* 3", "expected a number"),
])
def test_hostile_input_is_an_error_text(expression, error):
    with pytest.raises(CalculatorError, match=error.replace("(", r"\(").replace(")", r"\)")):
        evaluate(expression)


def test_errors_reach_the_model_as_text_and_are_counted():
    runner = ToolRunner([Calculator()])
    outcomes = runner.run([ToolCall("calculator", {"expression": "1/0"}), ToolCall("calculator", {"expression": "6*7"})])
    runner.close()
    assert [(o.status, o.response) for o in outcomes] == [("error", "Error: division by zero"), ("ok", "42")]
    assert issubclass(CalculatorError, ToolError) and runner.stats.errors == 1


def _random_expressions(count: int, seed: int = 0):
    """Strings over the calculator's alphabet, weighted towards long numbers, powers and nesting."""
    rng = random.Random(seed)
    pieces = list("0123456789.eE+-*/%^() ") + ["**", "//", "9" * 50, "(" * 20, ")" * 20, "1e999", "**9**9"]
    for _ in range(count):
        yield "".join(rng.choice(pieces) for _ in range(rng.randint(0, 60)))[: MAX_CHARS + 20]


def test_no_expression_raises_anything_but_an_error_text():
    answered = refused = 0
    for expression in _random_expressions(3000):
        try:
            answered += bool(show(evaluate(expression)))
        except CalculatorError as error:
            refused += bool(str(error))
    assert answered + refused == 3000 and answered > 0 and refused > 0
