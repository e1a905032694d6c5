"""The math-verify grader: equivalent forms accepted, wrong ones refused, a time limit per
answer that holds off the main thread, and MATH-500's reference solutions graded."""

import json
import threading
from pathlib import Path

import pytest

from grpo_runner_gsm8k.commands.grader_bench import measure
from grpo_runner_gsm8k.tasks.answers import boxed_spans, last_boxed
from grpo_runner_gsm8k.tasks.grading import TimedVerifier, grade_boxed, normalize_answer, set_members

MATH500 = Path(__file__).resolve().parents[3] / "shared/data/math500/test.jsonl"

# (reference, answer, equivalent)
CASES = [
    ("\\frac{1}{2}", "0.5", True), ("\\frac{1}{2}", "1/2", True), ("\\frac{1}{2}", "\\dfrac{1}{2}", True),
    ("\\frac{1}{2}", "\\tfrac12", True), ("\\frac{1}{2}", "0.5.", True), ("\\frac{3}{4}", "0.75", True), ("\\frac{1}{2}", "0.6", False),
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


def test_grade_boxed_reads_the_box(verifier):
    assert grade_boxed(verifier, "so \\boxed{\\dfrac{1}{2}}", "0.5") == ("\\frac{1}{2}", True)
    assert grade_boxed(verifier, "no box: 1/2", "0.5") == (None, False)


@pytest.mark.parametrize("box", [
    "9 \\text{ or } \\text{no solution}", "9 or 10", "9 \\text{ or } 10", "9\\text{ (or }10\\text{)}", "9, 10",
    "9 \\text{ or none}"])
def test_a_hedge_inside_the_box_is_wrong(verifier, box):
    assert grade_boxed(verifier, f"so $\\boxed{{{box}}}$.", "9").correct is False


def test_a_set_answer_may_say_or_but_not_hedge_after_a_unit(verifier):
    assert grade_boxed(verifier, "$\\boxed{9 \\text{ or } 10}$", "9, 10").correct
    assert grade_boxed(verifier, "$\\boxed{1,-2\\text{ (or }1,-3\\text{)}}$", "1,-2").correct is False
    assert grade_boxed(verifier, "$\\boxed{\\{1,-2\\}\\text{ (or }\\{1,-3\\}\\text{)}}$", "\\{1,-2\\}").correct is False
    assert grade_boxed(verifier, "$\\boxed{5.4 \\text{ cents} or 5.7 \\text{ cents}}$", "5.4 \\text{ cents}").correct is False
    assert grade_boxed(verifier, "$\\boxed{864 \\mbox{ inches}^2}$", "864 \\mbox{ inches}^2").correct


@pytest.mark.parametrize("box,right", [("52_8", True), ("52_{8}", True), ("52", True), ("52_{10}", False), ("42", False)])
def test_numbers_in_a_base_keep_their_base(verifier, box, right):
    assert grade_boxed(verifier, f"$\\boxed{{{box}}}$", "52_8").correct is right


def test_boxes_without_braces_and_fbox(verifier):
    assert grade_boxed(verifier, "so $\\boxed 3$.", "3") == ("3", True)
    assert grade_boxed(verifier, "so \\boxed12.", "12").correct
    assert grade_boxed(verifier, "so $\\boxed \\pi$", "\\pi").correct
    assert grade_boxed(verifier, "so $\\boxed C$", "\\text{(C)}").correct
    assert grade_boxed(verifier, "so $\\fbox{\\frac{1}{2}}$", "0.5").correct
    assert grade_boxed(verifier, "so $\\boxed 4$", "3").correct is False


def test_box_spans():
    assert boxed_spans("\\boxed{a{b}} x \\fbox {c} \\boxed 3. \\boxed\\pi \\boxed{d") == ["a{b}", "c", "3", "\\pi", None]
    assert boxed_spans("\\boxed{\\boxed{1}} \\boxedx \\boxed \\frac12 \\boxed 2^{10}") == ["\\boxed{1}", None, None]
    assert last_boxed("no box") is None and last_boxed("\\boxed{1} \\boxed{2") is None


def test_set_members():
    assert set_members("1,-2") == ["1", "-2"] and set_members("\\{1\\pm\\sqrt{5},-2\\}") == ["1\\pm\\sqrt{5}", "-2"]
    assert [set_members(a) for a in ("(1,2)", "[2,5)", "10,\\!080", "1,000", "(0,9) \\cup (9,36)", "3")] == [None] * 6


@pytest.mark.parametrize("completion,right", [
    ("$\\boxed{2}$. Checking again, it is $\\boxed{\\frac{4}{2}}$.", True),   # the same answer twice
    ("$\\boxed{2}$, or possibly $\\boxed{3}$.", False),                       # a second, different box
    ("$\\boxed{3}$, or rather $\\boxed{2}$.", False),                         # a different box before the right one
    ("in \\boxed{} form: $\\boxed{2}$", True),                                # an empty box holds no answer
    ("$\\boxed{2}$ then $\\boxed{2", False),                                  # an unclosed box
])
def test_several_boxes_must_agree(verifier, completion, right):
    assert grade_boxed(verifier, completion, "2").correct is right


@pytest.mark.parametrize("completion,right", [
    ("$\\boxed{1}$, $\\boxed{-2}$", True), ("$\\boxed{-2}$ and $\\boxed{1}$", True),
    ("$\\boxed{1}$, $\\boxed{-2}$, $\\boxed{3}$", False), ("$\\boxed{1}$", False),
    ("$\\boxed{-2}$, $\\boxed{1\\text{ (or }5\\text{)}}$", False),
])
def test_a_set_may_be_boxed_member_by_member(verifier, completion, right):
    assert grade_boxed(verifier, completion, "1,-2").correct is right


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


@pytest.mark.skipif(not MATH500.is_file(), reason=f"MATH-500 not found at {MATH500}")
def test_generated_answers_on_50_math500_problems():
    """`grpo-bench grader` on the first 50 problems: the goals of the full 500 (docs/evaluation.md)."""
    rows = [json.loads(line) for line in MATH500.read_text().splitlines()][:50]
    result = measure(rows, seed=0, plain=False)["grader"]
    assert result["wrong_rejected"] >= 0.999 and result["equivalents_accepted"] >= 0.985, result["misses"]
