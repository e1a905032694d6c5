"""The math-verify grader: equivalent forms accepted, wrong ones refused, a time limit per
answer that holds off the main thread, and MATH-500's reference solutions graded."""

import json
import threading
from pathlib import Path

import pytest

from grpo_runner_gsm8k.tasks.answers import last_boxed
from grpo_runner_gsm8k.tasks.grading import TimedVerifier, grade_boxed, normalize_answer

MATH500 = Path(__file__).resolve().parents[3] / "shared/data/math500/test.jsonl"

# (reference, answer, equivalent)
CASES = [
    ("\\frac{1}{2}", "0.5", True), ("\\frac{1}{2}", "1/2", True), ("\\frac{1}{2}", "\\dfrac{1}{2}", True),
    ("\\frac{1}{2}", "\\tfrac12", True), ("\\frac{3}{4}", "0.75", True), ("\\frac{1}{2}", "0.6", False),
    ("\\frac{1}{3}", "0.33", False),
    ("30^\\circ", "30", True), ("30^\\circ", "30^{\\circ}", True), ("30^\\circ", "60^\\circ", False),
    ("\\frac{\\pi}{6}", "30^\\circ", False),
    ("[2, 5)", "[2,5)", True), ("(-\\infty, 3]", "(-\\infty,3]", True), ("[2,5)", "(2,5)", False),
    ("(1, 2)", "(1,2)", True), ("\\left( 3, \\frac{\\pi}{2} \\right)", "(3, \\pi/2)", True), ("(1,2)", "(2,1)", False),
    ("\\text{(C)}", "C", True), ("\\text{(C)}", "\\text{C}", True), ("\\text{Evelyn}", "Evelyn", True),
    ("\\text{(C)}", "D", False), ("\\text{Evelyn}", "Emily", False),
    ("10", "10\\text{ cm}", True), ("5", "5\\text{ cm}^2", True), ("10", "11 \\text{ cm}", False),
    ("1000", "1,000", True), ("1000000", "1{,}000{,}000", True), ("1000", "1,001", False),
    ("2\\sqrt{2}", "\\sqrt{8}", True), ("2\\sqrt{2}", "\\sqrt{2}", False), ("x^2+2x+1", "(x+1)^2", True),
    ("10\\%", "10", True), ("0.1", "10\\%", True), ("3", "x=3", True), ("-2", "2", False),
]


@pytest.fixture(scope="module")
def verifier():
    checker = TimedVerifier(timeout_s=10.0)
    yield checker
    checker.close()


@pytest.mark.parametrize("reference,answer,equivalent", CASES)
def test_equivalent_forms_accepted_and_wrong_ones_refused(verifier, reference, answer, equivalent):
    assert verifier.equal(reference, answer) is equivalent


def test_a_pathological_answer_times_out_off_the_main_thread(caplog):
    checker = TimedVerifier(timeout_s=2.0)
    checker.equal("1", "\\frac{2}{2}")  # the worker's start is not part of an answer's time
    verdicts = []
    grader = threading.Thread(target=lambda: verdicts.append(checker.equal("3", "(10^{10^{10}})!")))
    grader.start()
    grader.join(timeout=60)
    assert not grader.is_alive() and verdicts == [False]
    assert checker.timeouts == 1 and "took over 2.0s" in caplog.text
    assert checker.equal("\\frac{1}{2}", "0.5")  # a fresh worker grades the next answer
    checker.close()


def test_grade_boxed_reads_the_last_box(verifier):
    assert grade_boxed(verifier, "so \\boxed{3} then \\boxed{\\dfrac{1}{2}}", "0.5") == ("\\frac{1}{2}", True)
    assert grade_boxed(verifier, "no box: 1/2", "0.5") == (None, False)


def test_normal_forms_for_majority_votes():
    assert normalize_answer("0.50") == normalize_answer("1/2") == "1/2"
    assert normalize_answer("1,000") == "1000"
    assert normalize_answer("1,2") == "1,2"
    assert normalize_answer("\\left( 3, \\dfrac{\\pi}{2} \\right).") == "(3,\\frac{\\pi}{2})"


@pytest.mark.skipif(not MATH500.is_file(), reason=f"MATH-500 not found at {MATH500}")
def test_math500_reference_solutions_grade_as_right(verifier):
    rows = [json.loads(line) for line in MATH500.read_text().splitlines()]
    misses = [row["unique_id"] for row in rows
              if not verifier.equal(row["answer"], last_boxed(row["solution"]) or "")]
    assert len(rows) == 500 and misses == []
