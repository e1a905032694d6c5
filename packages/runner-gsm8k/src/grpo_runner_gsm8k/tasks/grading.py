"""Grading boxed math answers with math-verify under a wall-clock limit per answer.

math-verify's own timeout is a SIGALRM timer, which Python allows only on the main thread,
and sympy can spend minutes on an expression such as `9^{9^{9^9}}`. So the comparison runs
in a worker process (`python -m grpo_runner_gsm8k.tasks.grading`, one JSON line per request and
reply): a reply that does not come within `timeout_s` kills the worker, the answer counts
as wrong and is logged, and the next request starts a fresh worker. This works from any
thread of any process, and nothing the worker does can stall the caller.
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

from grpo_runner_gsm8k.tasks.answers import last_boxed, parse_number

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


def grade_boxed(verifier: TimedVerifier, completion: str, reference: str) -> Graded:
    """The completion's last `\\boxed{}` graded against `reference`."""
    span = last_boxed(completion)
    if span is None or not span.strip() or len(span) > MAX_ANSWER_CHARS:
        return Graded(None, False)
    return Graded(normalize_answer(span), verifier.equal(reference, span))


def _serve() -> None:
    """The worker: one JSON [reference, prediction] per stdin line, one JSON bool per reply."""
    from math_verify import parse, verify

    logging.getLogger("math_verify").setLevel(logging.ERROR)  # its "timeout disabled" notice: the caller times us
    sys.stdout.write(READY)
    sys.stdout.flush()
    for line in sys.stdin:
        reference, prediction = json.loads(line)
        try:
            gold = parse(f"${reference}$", parsing_timeout=None)
            guess = parse(f"${prediction}$", parsing_timeout=None)
            verdict = bool(gold and guess and verify(gold, guess, timeout_seconds=None))
        except Exception:  # noqa: BLE001 - an answer sympy cannot handle is wrong, not a crash
            verdict = False
        sys.stdout.write(json.dumps(verdict) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    _serve()
