"""Completions that answer a MATH-500 problem right (the reference rewritten in an equivalent form)
or wrong (a changed number, another problem's answer, a hedge), for `grpo-bench grader`.

Each rewrite applies only where it keeps the value: `a/b` and decimals only for integer fractions,
reordered members only for a set (a bare comma list, which MATH asks for as "all solutions,
separated by commas", or `\\{...\\}`), `x = ` only before an answer without letters. The choices
(which problem's answer, which box comes first) come from one seeded generator, so a seed gives
the same cases every time.
"""

from __future__ import annotations

import random
import re
from fractions import Fraction
from typing import Callable, NamedTuple



class Case(NamedTuple):
    """A completion, the reference it is graded against, and whether it is right."""

    kind: str
    completion: str
    reference: str
    right: bool


def said(*answers: str, between: str = ", or possibly ") -> str:
    """A short solution ending in the given box(es) (a box already written stays as is)."""
    boxes = [a if a.startswith(("\\boxed", "\\fbox")) else f"\\boxed{{{a}}}" for a in answers]
    return "Working through the problem step by step, the final answer is $" + f"${between}$".join(boxes) + "$."


def set_members(ref: str) -> list[str] | None:
    """The members of a set answer (a bare comma list or `\\{...\\}`), else None. Written apart
    from the grader's own reading so that the cases do not follow the grader."""
    inner = ref[2:-2] if ref.startswith("\\{") and ref.endswith("\\}") else ref
    if inner.startswith(("(", "[")) or re.search(r"\d,(?:\\!|\d{3}(?!\d))", inner):
        return None
    members, depth, start = [], 0, 0
    for position, char in enumerate(inner):
        depth += 1 if char in "([{" else -1 if char in ")]}" else 0
        if char == "," and depth == 0:
            members, start = members + [inner[start:position].strip()], position + 1
    members.append(inner[start:].strip())
    return members if len(members) > 1 else None


_FRACTION = re.compile(r"(-?)\\[dt]?frac\{(\d+)\}\{(\d+)\}")
_DECIMAL = re.compile(r"-?\d*\.\d+")
_INTEGER = re.compile(r"-?\d+")
_TEXT = re.compile(r"\\text\{([^{}]*)\}")


def _terminating(value: Fraction) -> str | None:
    """The exact decimal of a fraction whose denominator has only the factors 2 and 5."""
    scale, rest = 0, value.denominator
    for factor in (2, 5):
        while rest % factor == 0:
            rest //= factor
    if rest != 1 or value.denominator == 1:
        return None
    while (value * 10 ** scale).denominator != 1:
        scale += 1
    digits = str(abs(value.numerator * 10 ** scale // value.denominator)).rjust(scale + 1, "0")
    return ("-" if value < 0 else "") + digits[:-scale] + "." + digits[-scale:]


def as_slash(ref: str) -> str | None:
    match = _FRACTION.fullmatch(ref)
    return f"{match[1]}{match[2]}/{match[3]}" if match else None


def as_decimal(ref: str) -> str | None:
    """`\\frac{3}{4}` -> `0.75`, `0.75` -> `\\frac{3}{4}` (exact values only)."""
    match = _FRACTION.fullmatch(ref)
    if match:
        return _terminating(Fraction(int(match[2]), int(match[3])) * (-1 if match[1] else 1))
    if _DECIMAL.fullmatch(ref):
        value = Fraction(ref)
        sign = "-" if value < 0 else ""
        return None if value.denominator == 1 else f"{sign}\\frac{{{abs(value.numerator)}}}{{{value.denominator}}}"
    return None


def dfrac(ref: str) -> str | None:
    return ref.replace("\\frac", "\\dfrac") if "\\frac" in ref else None


def brace_less_fraction(ref: str) -> str | None:
    """`\\frac{1}{2}` -> `\\frac12`, `\\sqrt{3}` -> `\\sqrt3` (single-digit arguments)."""
    text = re.sub(r"\\frac\{(\d)\}\{(\d)\}", r"\\frac\1\2", ref)
    text = re.sub(r"\\sqrt\{(\d)\}", r"\\sqrt\1", text)
    return text if text != ref else None


def spaced(ref: str) -> str | None:
    """Spaces after commas and around `+` and `=`, and thin spaces (`\\,`) inside brackets."""
    text = re.sub(r",(?!\\!|\d{3}(?!\d))\s*", ", ", ref)
    text = re.sub(r"\s*([+=])\s*", r" \1 ", text)
    text = re.sub(r"^([(\[])", r"\1\\, ", text)
    return text if text.strip() != ref.strip() else None


def _outer_brackets(ref: str) -> bool:
    """Whether the first bracket of `ref` closes at its end (`(1,2)`, `[2,5)`; not `(0,9) \\cup (9,36)`)."""
    if not ref or ref[0] not in "([" or ref[-1] not in ")]":
        return False
    depth = 0
    for position, char in enumerate(ref):
        depth += 1 if char in "([" else -1 if char in ")]" else 0
        if depth == 0 and position < len(ref) - 1:
            return False
    return True


def left_right(ref: str) -> str | None:
    """`(1,2)` -> `\\left(1,2\\right)`, and `\\left(...\\right)` -> `(...)`."""
    if "\\left" in ref:
        return ref.replace("\\left", "").replace("\\right", "")
    return f"\\left{ref[0]}{ref[1:-1]}\\right{ref[-1]}" if _outer_brackets(ref) else None


def trailing_period(ref: str) -> str | None:
    return ref + "."


def units(ref: str) -> str | None:
    return ref + "\\text{ units}" if _INTEGER.fullmatch(ref) or _DECIMAL.fullmatch(ref) else None


def thousands(ref: str) -> str | None:
    """`10080` -> `10,080`; `10,\\!080` -> `10080`."""
    if re.fullmatch(r"\d{1,3}(?:,\\!\s?\d{3})+", ref):
        return re.sub(r",\\!\s?", "", ref)
    if re.fullmatch(r"\d{4,}", ref):
        return f"{int(ref):,}"
    return None


def unwrap_text(ref: str) -> str | None:
    """`\\text{(C)}` -> `C`, `\\text{Evelyn}` -> `Evelyn`."""
    match = _TEXT.fullmatch(ref)
    return match[1].strip().strip("()") if match else None


def reordered_set(ref: str) -> str | None:
    """The members of a set answer in reverse order."""
    members = set_members(ref)
    if members is None:
        return None
    inner = ", ".join(reversed(members))
    return f"\\{{{inner}\\}}" if ref.startswith("\\{") else inner


def one_box_per_member(ref: str) -> str | None:
    members = set_members(ref)
    return None if members is None else "$, $".join(f"\\boxed{{{m}}}" for m in members)


def brace_less_box(ref: str) -> str | None:
    return f"\\boxed {ref}" if re.fullmatch(r"\d+|[A-Za-z]", ref) else None


def fbox(ref: str) -> str | None:
    return f"\\fbox{{{ref}}}"


REWRITES: dict[str, Callable[[str], str | None]] = {
    "spacing": spaced, "dfrac": dfrac, "slash_fraction": as_slash, "decimal_fraction": as_decimal,
    "brace_less_frac_sqrt": brace_less_fraction, "left_right": left_right, "trailing_period": trailing_period,
    "units_text": units, "thousands_separator": thousands, "text_unwrapped": unwrap_text,
    "reordered_set": reordered_set, "one_box_per_member": one_box_per_member, "brace_less_box": brace_less_box,
    "fbox": fbox,
}


# The question asks for an angle in degrees (an angle elsewhere in the problem is not enough).
_ANGLE = re.compile(r"in degrees|how many degrees|degree measure|measure of (?:the )?(?:\\angle|\$\\angle|angle)", re.I)


def _problem_variable(problem: str) -> str | None:
    match = re.search(r"\$([a-z])\$", problem)
    return match[1] if match else None


def context_rewrites(ref: str, problem: str) -> dict[str, str]:
    """Rewrites that depend on the problem: `n = 3` for `3`, `30^\\circ` for `30` in degrees."""
    found, variable = {}, _problem_variable(problem)
    letters = re.sub(r"\\[A-Za-z]+", "", ref)
    if variable and not re.search(r"[A-Za-z=,]", letters):
        found["variable_equation"] = f"{variable} = {ref}"
    if _ANGLE.search(problem) and _INTEGER.fullmatch(ref):
        found["degree_sign"] = ref + "^\\circ"
    if ref.endswith("^\\circ"):
        found["degree_sign"] = ref[: -len("^\\circ")]
    return found


def equivalent_cases(ref: str, problem: str) -> list[Case]:
    """The reference boxed, and each rewrite that applies to it (boxed; a box rewrite as written)."""
    cases = [Case("reference", said(ref), ref, True), Case("same_box_twice", said(ref, ref, between=". Checking again, it is "), ref, True)]
    forms = {kind: rewrite(ref) for kind, rewrite in REWRITES.items()} | context_rewrites(ref, problem)
    for kind, form in forms.items():
        if form is not None and form != ref:
            completion = said(*form.split("$, $"), between=", ") if kind == "one_box_per_member" else said(form)
            cases.append(Case(kind, completion, ref, True))
    return cases


def perturbed(ref: str, rng: random.Random) -> str | None:
    """`ref` with its last number before any `\\text{}` (a unit or a word) raised by 1..3, or None
    when it has none."""
    value_part = re.split(r"\\(?:text|mbox)\{", ref, maxsplit=1)[0]
    numbers = list(re.finditer(r"\d+", value_part))
    if not numbers:
        return None
    last = numbers[-1]
    return ref[: last.start()] + str(int(last[0]) + rng.randint(1, 3)) + ref[last.end():]


def _plain_form(answer: str) -> str:
    text = re.sub(r"\\left|\\right|\\[,;!]|\s+", "", answer).replace("\\dfrac", "\\frac")
    try:
        return str(Fraction(text))
    except ValueError:
        return text


def _differs(ref: str, other: str) -> bool:
    """Whether another problem's answer is plainly a different value (not the same normal form)."""
    return _plain_form(ref) != _plain_form(other)


def other_answer(ref: str, answers: list[str], rng: random.Random) -> str:
    while True:
        other = rng.choice(answers)
        if _differs(ref, other):
            return other


def wrong_cases(ref: str, answers: list[str], rng: random.Random) -> list[Case]:
    """A changed number, another problem's answer, and hedges inside and after the box."""
    changed, other = perturbed(ref, rng), other_answer(ref, answers, rng)
    wrong = changed or other
    forms = {"perturbed_number": said(changed) if changed else None, "other_problem_answer": said(other),
             "hedge_text_or_no_solution": said(ref + " \\text{ or } \\text{no solution}"),
             "hedge_or": said(f"{ref} or {wrong}"),
             "hedge_parenthetical": said(f"{ref}\\text{{ (or }}{wrong}\\text{{)}}"),
             "second_box_after": said(ref, wrong), "second_box_before": said(wrong, ref)}
    return [Case(kind, completion, ref, False) for kind, completion in forms.items() if completion is not None]


def cases(rows: list[dict], seed: int) -> list[Case]:
    """Every right and wrong case of the given MATH rows (`answer`, `problem`), in a seeded order."""
    rng = random.Random(seed)
    answers = [row["answer"] for row in rows]
    found: list[Case] = []
    for row in rows:
        found += equivalent_cases(row["answer"], row["problem"]) + wrong_cases(row["answer"], answers, rng)
    return found
