"""Grading boxed math answers with math-verify under a wall-clock limit per answer.

math-verify's own timeout is a SIGALRM timer, which Python allows only on the main thread,
and sympy can spend minutes on an expression such as `9^{9^{9^9}}`. So the comparison runs
in a worker process (`python -m grpo_runner_gsm8k.tasks.grading`, one JSON line per request and
reply): a reply that does not come within `timeout_s` kills the worker, the answer counts
as wrong and is logged, and the next request starts a fresh worker. This works from any
thread of any process, and nothing the worker does can stall the caller.

`grade_boxed` reads every box of a completion (`answers.boxed_spans`: `\\boxed{}`, `\\fbox{}`,
brace-less `\\boxed 3`), each as LaTeX only, and credits it when all its different boxes equal
the reference (or, for a set, when they join into it); docs/evaluation.md has the rules.
"""

from __future__ import annotations

import atexit
import json
import logging
import re
import select
import subprocess
import sys
import threading
import time
from typing import NamedTuple

from grpo_runner_gsm8k.tasks.answers import boxed_spans, parse_number

logger = logging.getLogger(__name__)

STARTUP_S = 120.0  # importing sympy and math-verify in a fresh process on a loaded 2-core host
READY = "ready\n"


class TimedVerifier:
    """`equal(reference, prediction)` by math-verify, each call limited to `timeout_s`."""

    def __init__(self, timeout_s: float = 5.0):
        if timeout_s <= 0:
            raise ValueError(f"grading timeout {timeout_s} must be > 0 seconds")
        self.timeout_s = timeout_s
        self.timeouts = 0  # answers that ran out of time (counted wrong)
        self._lock = threading.Lock()
        self._worker: subprocess.Popen | None = None
        atexit.register(self.close)

    def equal(self, reference: str, prediction: str) -> bool:
        """Whether the two LaTeX answers are equivalent; False on timeout or worker failure."""
        return _canonical(reference) == _canonical(prediction) or self.verify(reference, prediction)

    def verify(self, reference: str, prediction: str) -> bool:
        """math-verify's verdict alone (no string shortcut); False on timeout or worker failure."""
        with self._lock:
            return self._ask(reference, prediction)

    def _ask(self, reference: str, prediction: str) -> bool:
        worker = self._started()
        worker.stdin.write(json.dumps([reference, prediction]) + "\n")
        worker.stdin.flush()
        reply = _read_line(worker, self.timeout_s)
        if reply is None:
            self.timeouts += 1
            logger.warning("grading %r against %r took over %.1fs; counted wrong", prediction[:200],
                           reference[:200], self.timeout_s)
            self.close()
            return False
        return bool(json.loads(reply))

    def _started(self) -> subprocess.Popen:
        """The running worker, or a new one once it has imported math-verify (so the import
        never counts against an answer's time)."""
        if self._worker is not None and self._worker.poll() is None:
            return self._worker
        self._worker = subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True, bufsize=1)
        if _read_line(self._worker, STARTUP_S) != READY:
            self.close()
            raise RuntimeError(f"the math-verify grading worker did not start within {STARTUP_S:.0f}s; "
                               f"check that `{sys.executable} -m {__name__}` runs")
        return self._worker

    def close(self) -> None:
        """Stops the worker (the next `equal` starts another)."""
        worker, self._worker = self._worker, None
        if worker is not None and worker.poll() is None:
            worker.kill()
            worker.wait()


def _read_line(worker: subprocess.Popen, limit_s: float) -> str | None:
    """The worker's next reply line, or None when it has none within `limit_s` or died."""
    deadline = time.monotonic() + limit_s
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        ready, _, _ = select.select([worker.stdout], [], [], left)
        if ready:
            line = worker.stdout.readline()
            return line if line else None


_SPACING = re.compile(r"\\[,;:! ]|\\left|\\right|\s+|\$")


def _canonical(answer: str) -> str:
    """A cheap normal form that decides the common exact matches without the worker."""
    text = _SPACING.sub("", answer).replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    return text.rstrip(".")


def normalize_answer(answer: str) -> str:
    """The form majority votes compare: spacing, `\\left`/`\\right`, `$`, `\\dfrac` and a final
    period dropped; a plain number written as its exact value ("0.50", "1/2" -> "1/2")."""
    text = _canonical(answer)
    value = parse_number(text)
    if value is not None and _NUMBER_ONLY.fullmatch(text):
        return str(value)
    return text


_NUMBER_ONLY = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)?(?:\.\d*)?(?:/\d+)?")


class Graded(NamedTuple):
    """A completion's extracted, normalised answer (None: none found) and its verdict."""

    answer: str | None
    correct: bool


MAX_ANSWER_CHARS = 1000  # longer boxed spans are runaway generations, not answers
MAX_BOXES = 8  # more different boxed answers than this is a runaway generation, not an answer

_END_NOISE = re.compile(r"(?:\s|\\[,;:! ]|\.)+$")
_THOUSANDS = re.compile(r"(?<=\d),(?:\\!|\d{3}(?!\d))")
# "or" as a word (`9 or 10`, `9 \text{ (or 10)}`), not inside a command such as `\lor`.
_OR = re.compile(r"(?<![A-Za-z\\])or(?![A-Za-z])")
# math-verify reads a `\text{}` after an answer as a unit and drops all that follows it, so
# `9\text{ (or }10\text{)}` would read as 9: a box may follow its unit with a power only.
_UNIT_THEN = re.compile(r"\S\s*\\(?:text|mbox|textrm|mathrm)\{(?!\s*(?:or|and)\s*\})[^{}]*\}(.*)", re.S)
_UNIT_TAIL = re.compile(r"(?:\s|\.|\^\{?\d\}?|\\(?:text|mbox|textrm|mathrm)\{[^{}\d]*\})*")
# A number in a base (`52_8`, `4210_{5}`): math-verify reads the subscript as a name and drops it.
_BASE_NUMBER = re.compile(r"([0-9A-Za-z]+)_\{?(\d+)\}?|(\d+)")


def set_members(answer: str) -> list[str] | None:
    """The members of a set answer: a bare comma list (`1,-2`) or `\\{a, b\\}`; None for
    anything else (a tuple or interval in brackets, one number with thousands separators)."""
    text = answer.strip()
    if text.startswith("\\{") and text.endswith("\\}"):
        text = text[2:-2]
    members, depth, start = [], 0, 0
    for position, char in enumerate(text):
        depth += 1 if char in "([{" else -1 if char in ")]}" else 0
        if char == "," and depth == 0 and not _THOUSANDS.match(text, position):
            members.append(text[start:position].strip())
            start = position + 1
    members.append(text[start:].strip())
    return members if len(members) > 1 and all(members) else None


def _boxes(completion: str) -> list[str] | None:
    """The completion's different non-empty boxed answers, in order (trailing periods and
    spacing dropped); None when a box is unclosed, not one token, or a runaway."""
    boxes: dict[str, str] = {}
    for span in boxed_spans(completion):
        if span is None or len(span) > MAX_ANSWER_CHARS:
            return None
        box = _END_NOISE.sub("", span.strip())
        if box:
            boxes.setdefault(_canonical(box), box)
    return list(boxes.values()) if len(boxes) <= MAX_BOXES else None


def _hedged(box: str, reference: str) -> bool:
    """An "or" between answers, where the reference is no set and says no "or" itself."""
    return bool(_OR.search(box)) and not _OR.search(reference) and set_members(reference) is None


def _junk_after_unit(box: str) -> bool:
    tail = _UNIT_THEN.search(box)
    return tail is not None and not _UNIT_TAIL.fullmatch(tail[1])


def _same_base_number(reference: str, box: str) -> bool | None:
    """Digits and base compared exactly when a side is a number in a base (a bare number takes
    the other side's base); None when neither is, or a side is some other expression."""
    ref, got = _BASE_NUMBER.fullmatch(_canonical(reference)), _BASE_NUMBER.fullmatch(_canonical(box))
    if ref is None or got is None or not (ref[2] or got[2]):
        return None
    same_base = ref[2] == got[2] or not (ref[2] and got[2])
    return (ref[1] or ref[3]).lower() == (got[1] or got[3]).lower() and same_base


def _box_right(verifier: TimedVerifier, reference: str, box: str) -> bool:
    if _hedged(box, reference) or _junk_after_unit(box):
        return False
    in_base = _same_base_number(reference, box)
    return verifier.equal(reference, box) if in_base is None else in_base


def _right(verifier: TimedVerifier, boxes: list[str], reference: str) -> bool:
    """Every box equals the reference; or, for a set reference, the boxes joined as one list do."""
    if all(_box_right(verifier, reference, box) for box in boxes):
        return True
    if len(boxes) < 2 or set_members(reference) is None:
        return False
    joined = ", ".join(boxes)
    return _box_right(verifier, reference, f"\\{{{joined}\\}}" if reference.strip().startswith("\\{") else joined)


def grade_boxed(verifier: TimedVerifier, completion: str, reference: str) -> Graded:
    """The completion's boxed answers graded against `reference`: right when every box equals it
    (several different boxes are a hedge, so wrong), or when a set's members are boxed one by one.
    A box is read as LaTeX only (see `_serve`)."""
    boxes = _boxes(completion)
    if not boxes:
        return Graded(None, False)
    return Graded(",".join(normalize_answer(b) for b in boxes), _right(verifier, boxes, reference))


def _serve() -> None:
    """The worker: one JSON [reference, prediction] per stdin line, one JSON bool per reply.

    The prediction is read as LaTeX only: math-verify's plain-expression reading would take the
    last number out of a box whose LaTeX does not parse (`9 \\text{ or } \\text{no solution}` -> 9).
    The reference is trusted and read both ways."""
    from math_verify import LatexExtractionConfig, parse, verify

    logging.getLogger("math_verify").setLevel(logging.ERROR)  # its "timeout disabled" notice: the caller times us
    latex_only = [LatexExtractionConfig()]
    sys.stdout.write(READY)
    sys.stdout.flush()
    for line in sys.stdin:
        reference, prediction = json.loads(line)
        try:
            gold = parse(f"${reference}$", parsing_timeout=None)
            prediction = _END_NOISE.sub("", " ".join(prediction.split()))  # one line, no final period
            guess = parse(f"${prediction}$", extraction_config=latex_only, parsing_timeout=None)
            verdict = bool(gold and guess and verify(gold, guess, timeout_seconds=None))
        except Exception:  # noqa: BLE001 - an answer sympy cannot handle is wrong, not a crash
            verdict = False
        sys.stdout.write(json.dumps(verdict) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    _serve()
