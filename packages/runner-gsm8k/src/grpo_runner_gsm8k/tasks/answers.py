"""Final answers of completions: extraction, parsing and equivalence.

Final-answer extraction (`extract_answer`) looks for explicit markers first, in
this order, and takes the first that yields a parseable answer:

1. `#### <answer>`: the last `####` marker (the GSM8K format);
2. `\\boxed{<answer>}`: the last `\\boxed{...}` or `\\fbox{...}` (or brace-less `\\boxed 3`);
3. an answer statement: the last of `answer is <answer>`, `answer: <answer>`,
   `answer = <answer>` (case-insensitive, optionally `final answer`), or a line
   starting with `A: <answer>` (the Q:/A: few-shot format);
4. the fallback (`CorrectnessOptions.fallback`): by default the last non-empty
   line, when it holds exactly one number ("So she pays $18."). There is
   deliberately no "last number anywhere" rule: an unmarked completion whose
   last line is a calculation ("16 - 3 = 13") is not guessed at.

The answer text is read from its start: an optional sign, currency symbol and
thousands commas, a decimal or `a/b` fraction; trailing units, `%` and periods
are ignored ("$1,200.", "18 apples"). Anything else (`\\frac{1}{2}`,
`2\\sqrt{2}`) goes to `math_verify`, with a per-expression timeout and a
length cap so that one adversarial completion cannot stall training.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from fractions import Fraction
from dataclasses import dataclass
from typing import Callable, Literal

from grpo_core.config import setting


logger = logging.getLogger(__name__)

# ---------------------------------------------------------------- parsing numbers

_LEAD_NOISE = re.compile(r"^(?:\s|[:=*_`(\[{]|\\\$|\\\(|\\\[|\$)+")
_NUMBER = re.compile(
    r"(?P<sign>[-+\u2212]?)\s*(?:\\?\$\s*)?"
    r"(?P<int>\d{1,3}(?:,\d{3})+(?!\d)|\d+)?(?P<dec>\.\d+)?"
    r"(?:\s*/\s*(?P<den>\d+)(?!\d|\.\d))?")
# A number followed by these is the start of an expression ("2^{10}", "3\frac{1}{2}").
_EXPRESSION_AFTER = re.compile(r"\s*(?:\^|\\(?:[dt]?frac|sqrt|pi|cdot|times)\b)")
ANY_NUMBER = re.compile(r"\d{1,3}(?:,\d{3})+(?!\d)|\d*\.\d+|\d+")
_LATEX_HINT = re.compile(r"\\[a-zA-Z]+|\^")
# Longer digit runs are runaway generations, not answers (and int() refuses > 4300 digits).
MAX_DIGITS = 100


def _strip_lead(text: str) -> str:
    return _LEAD_NOISE.sub("", text, count=1)


def _fraction(match: re.Match) -> Fraction | None:
    whole = (match.group("int") or "0").replace(",", "")
    if len(whole) + len(match.group("dec") or "") + len(match.group("den") or "") > MAX_DIGITS:
        return None
    value = Fraction(whole + (match.group("dec") or ""))
    if match.group("den"):
        denominator = int(match.group("den"))
        if denominator == 0:
            return None
        value /= denominator
    return -value if match.group("sign") in ("-", "\u2212") else value


def parse_number(text: str) -> Fraction | None:
    """The exact value of the plain number `text` starts with, or None.

    Leading `$`, `:`, `**` and the like are skipped; trailing units, `%` and
    periods are ignored. None when there is no number or it begins a LaTeX
    expression ("2^{10}").

    >>> parse_number("$1,200.")
    Fraction(1200, 1)
    >>> parse_number("1/2") == parse_number("0.5")
    True
    """
    text = _strip_lead(text)
    match = _NUMBER.match(text)
    if match is None or not (match.group("int") or match.group("dec")):
        return None
    if _EXPRESSION_AFTER.match(text, match.end()):
        return None
    return _fraction(match)


# ---------------------------------------------------------------- locating the answer

_HASHES = re.compile(r"####[ \t]*\n?[ \t]*([^\n]*)")
_BOX = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
# A box without braces holds one token, as in TeX: a number, a command (`\pi`) or a letter.
_BRACE = re.compile(r"\s*\{")
_BRACE_LESS = re.compile(r"\s*(\d+(?:\.\d+)?|\\[A-Za-z]+)(?![\w{^_]|\.\d)|\s+([A-Za-z])(?![\w{^_\\])")
_STATEMENT = re.compile(
    r"(?:\b(?:final\s+)?answer\s*(?:is|was|=|:)|^[ \t]*A:)[ \t]*([^\n]*)",
    re.IGNORECASE | re.MULTILINE)


def _last_group(pattern: re.Pattern, text: str) -> str | None:
    """The captured span of the pattern's last match (patterns here have one group)."""
    spans = pattern.findall(text)
    return spans[-1] if spans else None


def _box_at(text: str, start: int) -> tuple[str | None, int]:
    """The content of the box whose command ends at `start` (None when unclosed or not one
    token) and where the text after it begins."""
    brace = _BRACE.match(text, start)
    if brace is None:
        token = _BRACE_LESS.match(text, start)
        return (token[1] or token[2], token.end()) if token else (None, start)
    depth = 0
    for pos in range(brace.end() - 1, len(text)):
        depth += {"{": 1, "}": -1}.get(text[pos], 0)
        if depth == 0:
            return text[brace.end():pos], pos + 1
    return None, len(text)


def boxed_spans(text: str) -> list[str | None]:
    """The content of every `\\boxed{...}` / `\\fbox{...}` (braces balanced) or brace-less
    `\\boxed 3` (one token), in order; None for a box that is unclosed or not one token.
    A box inside another is part of the outer one's content."""
    spans, position = [], 0
    while (box := _BOX.search(text, position)) is not None:
        span, position = _box_at(text, box.end())
        spans.append(span)
    return spans


def last_boxed(text: str) -> str | None:
    """Content of the last box (see `boxed_spans`); None if absent, unclosed or unreadable."""
    spans = boxed_spans(text)
    return spans[-1] if spans else None


def last_boxed_or_line(text: str) -> str | None:
    """The last box's content, else the last non-empty line; None for a text with neither."""
    span = last_boxed(text)
    if span is not None:
        return span
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else None


def _final_line_number(text: str) -> str | None:
    """The last non-empty line, when it holds exactly one number."""
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines or len(ANY_NUMBER.findall(lines[-1])) != 1:
        return None
    number = ANY_NUMBER.search(lines[-1])
    sign = "-" if lines[-1][:number.start()].rstrip().endswith(("-", "\u2212")) else ""
    return sign + lines[-1][number.start():]


def _leading_number(text: str) -> str | None:
    """The completion itself, when it starts with a number ("8", "8 because ...")."""
    return text if parse_number(text) is not None else None


Fallback = Literal["final_line", "leading_number", "none"]
_FALLBACKS: dict[str, Callable[[str], str | None]] = {
    "final_line": _final_line_number,
    "leading_number": _leading_number,
    "none": lambda text: None,
}


def answer_candidates(text: str, fallback: Fallback = "final_line") -> list[str]:
    """Candidate answer spans of a completion, highest precedence first."""
    found = [_last_group(_HASHES, text), last_boxed(text),
             _last_group(_STATEMENT, text), _FALLBACKS[fallback](text)]
    return [span.strip() for span in found if span is not None and span.strip()]


# ---------------------------------------------------------------- equivalence


@dataclass(frozen=True)
class CorrectnessOptions:
    """Options of the `correctness` reward (1.0 when the final answer is right)."""

    fallback: Fallback = setting(
        "final_line", "Answer source when no marker is present: final_line = the last non-empty line "
        "if it holds exactly one number; leading_number = the number the completion starts with "
        "(for tiny models answering '3+5=' with '8'); none = markers only.")
    max_latex_chars: int = setting(
        100, "Longer non-numeric answers are not handed to math_verify (bounds parsing cost).", ge=1)
    latex_timeout_s: int = setting(1, "Timeout of one math_verify parse or comparison (whole seconds).", ge=1)
    latex_budget_s: float = setting(
        5.0, "Total math_verify time per reward call; later LaTeX answers score 0.", gt=0.0)


class LatexChecker:
    """math_verify for answers that are not plain numbers, with bounded cost.

    Each parse/verify gets `timeout_s` (a SIGALRM timer, so only on the main
    thread) and a call spends at most `budget_s` in total; past that, LaTeX
    answers score 0. Off the main thread there is no timer, so expressions
    with powers (whose evaluation can run for minutes) are refused.
    """

    def __init__(self, options: CorrectnessOptions):
        self.max_chars, self.timeout_s = options.max_latex_chars, options.latex_timeout_s
        self.budget_s, self.spent_s = options.latex_budget_s, 0.0

    def _timeout(self) -> int | None:
        return self.timeout_s if threading.current_thread() is threading.main_thread() else None

    def _allowed(self, text: str) -> bool:
        if len(text) > self.max_chars or self.spent_s >= self.budget_s:
            return False
        return self._timeout() is not None or not ("^" in text or "**" in text)

    def equal(self, reference: str, span: str) -> bool:
        if not (self._allowed(span) and self._allowed(reference)):
            return False
        from math_verify import parse, verify  # imported here: it takes seconds, outside the budget

        started, timeout = time.perf_counter(), self._timeout()
        try:
            gold = parse(f"${reference}$", parsing_timeout=timeout)
            pred = parse(f"${span}$", parsing_timeout=timeout)
            return bool(gold and pred and verify(gold, pred, timeout_seconds=timeout))
        finally:
            self.spent_s += time.perf_counter() - started


def _latex_span(span: str) -> str:
    """The LaTeX expression a span starts with: up to the end of a `$...$` or the line."""
    expression = re.split(r"\$|\\\)|\\\]|\n", _strip_lead(span), maxsplit=1)[0]
    return expression.strip().rstrip(".")


Answer = Fraction | str


def read_answer(span: str) -> Answer | None:
    """A span as an exact number, else as a LaTeX expression, else None (unreadable)."""
    value = parse_number(span)
    if value is not None:
        return value
    expression = _latex_span(span)
    return expression if _LATEX_HINT.search(expression) else None


def _as_latex(value: Answer) -> str:
    return str(value) if isinstance(value, Fraction) else value


def _equal(reference: Answer, answer: Answer, latex: LatexChecker) -> bool:
    if isinstance(reference, Fraction) and isinstance(answer, Fraction):
        return reference == answer
    return latex.equal(_as_latex(reference), _as_latex(answer))


def extract_answer(completion: str, fallback: Fallback = "final_line") -> Answer | None:
    """The completion's final answer (see the module doc), or None when it has none."""
    for span in answer_candidates(completion, fallback):
        value = read_answer(span)
        if value is not None:
            return value
    return None


def _reference_value(reference: str) -> Answer:
    value = read_answer(reference)
    if value is None:
        raise ValueError(f"reference answer {reference!r} is neither a number nor a LaTeX expression; "
                         f"the correctness reward compares numbers, so fix the task's answers")
    return value


def is_correct(completion: str, reference: str, fallback: Fallback = "final_line",
               latex: LatexChecker | None = None) -> bool:
    """Whether the completion's final answer equals `reference` (see the module doc)."""
    expected = _reference_value(reference)
    answer = extract_answer(completion, fallback)
    return answer is not None and _equal(expected, answer, latex or LatexChecker(CorrectnessOptions()))
