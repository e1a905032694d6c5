"""Answer extraction, the correctness and format rewards, and failure isolation in `score`."""

import threading
from fractions import Fraction

import numpy as np
import pytest

from grpo_runner_gsm8k.tasks.answers import extract_answer, is_correct, parse_number
from grpo_runner_gsm8k.tasks.rewards import CorrectnessOptions, FormatOptions, correctness_reward, format_reward
from grpo_runner_gsm8k.training.scoring import score


@pytest.mark.parametrize("completion, expected", [
    ("She pays 6 + 12 = 18.\n#### 18", 18),
    ("#### 1,200", 1200),
    ("The total is $\\boxed{18}$.", 18),
    ("So \\boxed{\\frac{1}{2}} of the cake is left.", "\\frac{1}{2}"),
    ("Adding them gives 7. The answer is 18.", 18),
    ("The final answer is: **42**", 42),
    ("Answer: $1,200", 1200),
    ("Q: How many?\nA: -3", -3),
    ("Job A: 5 dollars an hour.\nSo she earns 7 dollars.", 7),  # "A:" counts only at a line start
    ("The temperature fell by 5 degrees.\n#### -3 degrees", -3),
    ("#### 0.5", Fraction(1, 2)),
    ("#### 1/2.", Fraction(1, 2)),
    ("#### 18 apples.", 18),
    ("#### $18.00", 18),
    ("#### \u22127", -7),
    ("Therefore she pays $18 in total.", 18),  # fallback: last line holds one number
])
def test_extracts_the_final_answer(completion, expected):
    assert extract_answer(completion) == expected


@pytest.mark.parametrize("completion", [
    "16 - 3 = 13\n13 * 2 = 26",      # a calculation, not an answer: no last-number guess
    "I do not know.",
    "",
    "#### \n",
    "#### " + "3" * 5000,            # a runaway digit string is not an answer
])
def test_unmarked_calculations_have_no_answer(completion):
    assert extract_answer(completion) is None


def test_markers_take_precedence_over_later_numbers():
    assert extract_answer("#### 18\nThat was easy, 5 minutes.") == 18
    assert extract_answer("\\boxed{7}\nThe answer is 9") == 7
    assert extract_answer("The answer is 4.\n2 + 2 = 4 and 3 more make 7") == 4


def test_unreadable_marker_falls_through_to_the_next():
    assert extract_answer("#### eighteen\nThe answer is 18.") == 18


@pytest.mark.parametrize("completion, reference", [
    ("#### 0.5", "1/2"),
    ("#### 1/2", "0.5"),
    ("\\boxed{\\frac{1}{2}}", "0.5"),
    ("\\boxed{0.5}", "\\frac{1}{2}"),
    ("The answer is $1,200.", "1200"),
    ("#### 3.0", "3"),
    ("#### 50%", "50"),
    ("\\boxed{\\dfrac{6}{4}}", "3/2"),
    ("\\boxed{2^{10}}", "1024"),
])
def test_numeric_equivalence(completion, reference):
    assert is_correct(completion, reference)


@pytest.mark.parametrize("completion, reference", [
    ("#### 0.33", "1/3"),
    ("#### 19", "18"),
    ("\\boxed{2^{10}}", "2"),
    ("#### 1,2000", "12000"),
])
def test_numeric_differences(completion, reference):
    assert not is_correct(completion, reference)


def test_parse_number_reads_only_the_leading_number():
    assert parse_number(":  $ 1,234.5 dollars") == Fraction(24690, 20)
    assert parse_number("1/0") is None
    assert parse_number("no number 5") is None


def test_fallback_modes():
    assert extract_answer("8 because 3 + 5", fallback="leading_number") == 8
    assert extract_answer("8 because 3 + 5") is None
    assert extract_answer("So it is 18.", fallback="none") is None


def test_correctness_reward_scores_a_batch():
    correctness = correctness_reward(CorrectnessOptions())
    completions = ["#### 72", "#### 71", "The answer is \\boxed{72}", "no idea"]
    assert correctness(completions, ["72"] * 4) == [1.0, 0.0, 1.0, 0.0]
    with pytest.raises(ValueError, match="2 completions but 1 answers"):
        correctness(["#### 1", "#### 2"], ["1"])


def test_correctness_rejects_unreadable_references():
    with pytest.raises(ValueError, match="neither a number nor a LaTeX"):
        is_correct("#### 3", "three")


def test_adversarial_latex_scores_zero_within_the_budget():
    """Towers of powers and deep nesting are refused or time out (scored 0) instead of hanging."""
    options = CorrectnessOptions(latex_timeout_s=1, latex_budget_s=1.0)
    correctness = correctness_reward(options)
    completions = ["\\boxed{9^{9^{9^{9}}}}"] * 6 + ["\\boxed{" + "(" * 5000 + "1" + ")" * 5000 + "}"]
    assert correctness(completions, ["5"] * len(completions)) == [0.0] * len(completions)


def test_off_main_thread_powers_are_refused_without_hanging():
    correctness = correctness_reward(CorrectnessOptions())
    result = {}
    worker = threading.Thread(target=lambda: result.update(
        r=correctness(["\\boxed{9^{9^{9^{9}}}}", "\\boxed{\\frac{1}{2}}", "#### 7"], ["5", "0.5", "7"])))
    worker.start()
    worker.join(timeout=30)
    assert result["r"] == [0.0, 1.0, 1.0]


@pytest.mark.parametrize("style, good, bad", [
    ("hashes", ["work\n#### 18", "#### -3.5\n", "#### $1,200."],
     ["#### 18\nmore text", "#### eighteen", "18", "#### 18 apples"]),
    ("boxed", ["so \\boxed{18}.", "\\boxed{\\frac{1}{2}}"], ["\\boxed{}", "\\boxed{18}\nmore", "18"]),
    ("number_only", ["8", " 12\n", "-3"], ["8 apples", "#### 8", "", "1 2"]),
])
def test_format_reward(style, good, bad):
    fmt = format_reward(FormatOptions(style=style))
    assert fmt(good + bad, [""] * (len(good) + len(bad))) == [1.0] * len(good) + [0.0] * len(bad)


def _raises_on_bad(completions, answers):
    if any("bad" in c for c in completions):
        raise RuntimeError("cannot score 'bad'")
    return [1.0] * len(completions)


def test_score_isolates_a_failing_sample():
    correctness = correctness_reward(CorrectnessOptions())
    fns = {"correctness": (correctness, 1.0), "fragile": (_raises_on_bad, 0.5)}
    scores = score(fns, ["#### 3", "bad #### 3", "#### 4"], ["3", "3", "3"])
    np.testing.assert_allclose(scores.per_fn["fragile"], [1.0, 0.0, 1.0])
    np.testing.assert_allclose(scores.per_fn["correctness"], [1.0, 1.0, 0.0])
    np.testing.assert_allclose(scores.total, [1.5, 1.0, 0.5])
    assert scores.errors == {"correctness": 0, "fragile": 1}
    assert scores.total.dtype == np.float32 and scores.total.shape == (3,)


def test_score_counts_wrong_lengths_and_non_finite_values():
    def short(completions, answers):
        return [1.0] * (len(completions) - 1) if len(completions) > 1 else [float("nan")]

    def always_raises(completions, answers):
        raise KeyError("broken plugin")

    scores = score({"short": (short, 1.0), "broken": (always_raises, 2.0)}, ["a", "b"], ["1", "1"])
    np.testing.assert_array_equal(scores.total, [0.0, 0.0])
    assert scores.errors == {"short": 2, "broken": 2}


def test_score_checks_its_inputs_and_handles_empty_batches():
    with pytest.raises(ValueError, match="completions but"):
        score({}, ["a"], [])
    empty = score({"c": (correctness_reward(CorrectnessOptions()), 1.0)}, [], [])
    assert empty.total.shape == (0,) and empty.errors == {"c": 0}


def test_a_none_scores_zero_counts_as_an_error_and_is_not_asked_again():
    """The rule of docs/rewards.md: a reward that cannot score a completion returns None for it; the row
    scores 0 from that function, counts in its errors, and the other rows keep the batch call's values
    (no retry one by one: a judge or a sandbox would pay for every row again)."""
    calls = []

    def abstains(completions, answers):
        calls.append(len(completions))
        return [None if c == "skip" else 0.5 for c in completions]

    scores = score({"abstains": (abstains, 2.0), "one": (lambda c, a: [1.0] * len(c), 1.0)},
                   ["a", "skip", "b"], ["1", "1", "1"])
    np.testing.assert_array_equal(scores.per_fn["abstains"], [0.5, 0.0, 0.5])
    np.testing.assert_array_equal(scores.total, [2.0, 1.0, 2.0])
    assert scores.errors == {"abstains": 1, "one": 0} and calls == [3]


def test_score_gives_each_completion_its_question():
    from grpo_core.contracts import CompletionText
    from types import SimpleNamespace
    from grpo_core.contracts import Example
    from grpo_runner_gsm8k.samplers.plain import score_groups

    seen = []

    def reads_questions(completions, answers):
        seen.extend(c.question for c in completions)
        return [1.0] * len(completions)

    run = SimpleNamespace(cfg=SimpleNamespace(rollout=SimpleNamespace(n=2), task=SimpleNamespace(system_prompt=None)),
                          inputs=SimpleNamespace(rewards={"q": (reads_questions, 1.0)}))
    completions = [CompletionText(t, 1, 4, True) for t in "abcd"]
    score_groups(run, [Example("2+2?", "4"), Example("3+3?", "6")], completions)
    assert seen == ["2+2?", "2+2?", "3+3?", "3+3?"] and CompletionText("x", 1, 1, True).question == ""
