"""The `calculator` tool: exact arithmetic by a small recursive-descent parser (never `eval`).

Grammar, loosest first (Python's precedence; `^` is a power too, as models often write it):

    sum     := product (("+" | "-") product)*
    product := unary (("*" | "/" | "//" | "%") unary)*
    unary   := ("+" | "-") unary | power
    power   := atom (("**" | "^") unary)?
    atom    := number | "(" sum ")"

Numbers are exact fractions (0.1 + 0.2 is 0.3); a fractional power goes through floats.
Input longer than MAX_CHARS, nesting deeper than MAX_DEPTH, and any result over MAX_DIGITS
digits are refused before any work is done on them, so no expression can take the trainer's
time or memory; every refusal is a `CalculatorError` with the text the model reads.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from decimal import Decimal, localcontext
from fractions import Fraction

from grpo_core.multi_turn import ToolError

MAX_CHARS = 500
MAX_DEPTH = 50
MAX_DIGITS = 1000
MAX_BITS = int(MAX_DIGITS * math.log2(10)) + 1
SHOWN_DIGITS = 15  # significant digits of a result that is not an integer (a float's worth)
TOKEN = re.compile(r"\s*(?:(?P<number>(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)|(?P<op>\*\*|//|[-+*/%^()]))")


class CalculatorError(ToolError):
    """An expression the calculator refuses; the message is what the model reads."""


def tokenize(text: str) -> list[str]:
    tokens, position = [], 0
    text = text.rstrip()
    while position < len(text):
        match = TOKEN.match(text, position)
        if match is None:
            raise CalculatorError(f"unexpected {text[position:].strip()[:10]!r} at character {position}; "
                                  "use numbers, + - * / // % ** ^ and parentheses")
        tokens.append(match.group("number") or match.group("op"))
        position = match.end()
    return tokens


def _number(token: str) -> Fraction:
    mantissa, _, exponent = token.lower().partition("e")
    if len(mantissa.replace(".", "").lstrip("0")) > MAX_DIGITS or (exponent and abs(int(exponent)) > MAX_DIGITS):
        raise CalculatorError(f"the number {token[:20]}... is too large (over {MAX_DIGITS} digits)")
    return Fraction(token)


def _checked(value: Fraction) -> Fraction:
    if max(value.numerator.bit_length(), value.denominator.bit_length()) > MAX_BITS:
        raise CalculatorError(f"the result is too large (over {MAX_DIGITS} digits)")
    return value


def _power(base: Fraction, exponent: Fraction) -> Fraction:
    if exponent.denominator != 1:
        if base < 0:
            raise CalculatorError("a negative number to a fractional power is not a real number")
        try:
            result = float(base) ** float(exponent)
        except OverflowError:
            result = math.inf
        if not math.isfinite(result):
            raise CalculatorError(f"the result is too large (over {MAX_DIGITS} digits)")
        return _checked(Fraction(result))
    size = max(base.numerator.bit_length(), base.denominator.bit_length())
    if abs(base) not in (0, 1) and abs(exponent.numerator) * max(size - 1, 1) > MAX_BITS:
        raise CalculatorError(f"the result is too large (over {MAX_DIGITS} digits)")
    if base == 0 and exponent < 0:
        raise CalculatorError("division by zero")
    return _checked(base ** exponent.numerator)


def _apply(operator: str, left: Fraction, right: Fraction) -> Fraction:
    if operator in ("/", "//", "%") and right == 0:
        raise CalculatorError("division by zero")
    if operator in ("**", "^"):
        return _power(left, right)
    result = {"+": lambda: left + right, "-": lambda: left - right, "*": lambda: left * right,
              "/": lambda: left / right, "//": lambda: Fraction(left // right), "%": lambda: left % right}[operator]()
    return _checked(result)


@dataclass
class _Parser:
    tokens: list[str]
    position: int = 0
    depth: int = 0

    def peek(self) -> str | None:
        return self.tokens[self.position] if self.position < len(self.tokens) else None

    def take(self) -> str:
        token = self.peek()
        if token is None:
            raise CalculatorError("the expression ends too early")
        self.position += 1
        return token

    def nested(self) -> None:
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise CalculatorError(f"the expression is nested too deeply (over {MAX_DEPTH} levels)")

    def sum(self) -> Fraction:
        value = self.product()
        while self.peek() in ("+", "-"):
            value = _apply(self.take(), value, self.product())
        return value

    def product(self) -> Fraction:
        value = self.unary()
        while self.peek() in ("*", "/", "//", "%"):
            value = _apply(self.take(), value, self.unary())
        return value

    def unary(self) -> Fraction:
        if self.peek() in ("+", "-"):
            self.nested()
            sign = self.take()
            value = self.unary()
            self.depth -= 1
            return -value if sign == "-" else value
        return self.power()

    def power(self) -> Fraction:
        base = self.atom()
        if self.peek() in ("**", "^"):
            operator = self.take()
            self.nested()
            exponent = self.unary()
            self.depth -= 1
            return _apply(operator, base, exponent)
        return base

    def atom(self) -> Fraction:
        token = self.take()
        if token == "(":
            self.nested()
            value = self.sum()
            if self.take() != ")":
                raise CalculatorError("a parenthesis is not closed")
            self.depth -= 1
            return value
        if token[0].isdigit() or token[0] == ".":
            return _number(token)
        raise CalculatorError(f"expected a number or '(' but found {token!r}")


def evaluate(expression: str) -> Fraction:
    """The exact value of `expression`; raises CalculatorError (and nothing else) otherwise."""
    if len(expression) > MAX_CHARS:
        raise CalculatorError(f"the expression is too long ({len(expression)} characters; at most {MAX_CHARS})")
    parser = _Parser(tokenize(expression))
    if not parser.tokens:
        raise CalculatorError("the expression is empty")
    value = parser.sum()
    if parser.peek() is not None:
        raise CalculatorError(f"unexpected {parser.peek()!r} after a complete expression")
    return value


def show(value: Fraction) -> str:
    """An integer in full; anything else to SHOWN_DIGITS significant digits."""
    if value.denominator == 1:
        return str(value.numerator)
    with localcontext() as context:
        context.prec = SHOWN_DIGITS
        return str((Decimal(value.numerator) / Decimal(value.denominator)).normalize())


class Calculator:
    """A `grpo_core.contracts.Tool`."""

    name = "calculator"
    description = "Evaluate an arithmetic expression exactly: numbers, + - * / // % ** (or ^) and parentheses."
    parameters = {"type": "object", "additionalProperties": False, "required": ["expression"],
                  "properties": {"expression": {"type": "string", "description": "e.g. (12 + 7) * 3 / 4"}}}

    def __init__(self, options=None):
        self.options = options

    def __call__(self, arguments) -> str:
        return show(evaluate(arguments["expression"]))
