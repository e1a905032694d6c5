"""The eval metrics against hand-computed values."""

from math import comb

import pytest

from grpo_core.errors import UserError
from grpo_runner_gsm8k.evaluation.metrics import (breakdown, greedy_accuracy, ks_up_to, maj_at_k, majority_index,
                                            mean_at_n, pass_at_k, summarize)


def closed_form(n: int, c: int, k: int) -> float:
    return 1 - comb(n - c, k) / comb(n, k)


@pytest.mark.parametrize("n,c,k", [(1, 0, 1), (1, 1, 1), (4, 1, 2), (5, 2, 3), (8, 3, 4), (8, 0, 8),
                                   (10, 7, 4), (16, 1, 16), (100, 3, 50)])
def test_pass_at_k_equals_the_closed_form(n, c, k):
    assert pass_at_k(n, c, k) == pytest.approx(closed_form(n, c, k), abs=1e-12)


def test_pass_at_k_by_hand():
    # 4 samples, 1 correct: a pair misses it in C(3,2)=3 of C(4,2)=6 pairs.
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 3, 2) == 1.0


def test_pass_at_k_is_stable_for_large_n():
    # C(2000, 1000) overflows a float; the product form does not.
    assert pass_at_k(2000, 1, 1000) == pytest.approx(0.5)


def test_k_larger_than_n_is_a_user_error():
    with pytest.raises(UserError, match=r"k = 5 is outside 1..n with n = 4"):
        pass_at_k(4, 1, 5)


def test_ks_are_powers_of_two_then_n():
    assert ks_up_to(1) == [1]
    assert ks_up_to(8) == [1, 2, 4, 8]
    assert ks_up_to(6) == [1, 2, 4, 6]


def test_majority_ties_go_to_the_first_seen_answer():
    assert majority_index(["3", "5", "5", "3"]) == 0
    assert majority_index(["5", "3", "3", "5"]) == 0
    assert majority_index([None, "7", "2", "2"]) == 2
    assert majority_index([None, None]) is None


def test_maj_at_k_grades_the_winner():
    answers = [["1", "2", "2", None], ["4", "4", "9", "9"], [None, None, None, None]]
    verdicts = [[True, False, False, False], [False, False, True, True], [False] * 4]
    assert maj_at_k(answers, verdicts, 4) == pytest.approx(0.0)  # "2" wins q0, the tie "4" wins q1
    assert maj_at_k(answers, verdicts, 1) == pytest.approx(1 / 3)  # q0's first sample is right
    assert maj_at_k([["9", "4", "4", "9"]], [[True, False, False, True]], 4) == 1.0  # tie -> first seen "9"


def test_summary_metrics():
    verdicts = [[True, False], [False, False], [True, True]]
    answers = [["1", "2"], ["3", None], ["5", "5"]]
    out = summarize(verdicts, answers)
    assert out["mean@2"] == pytest.approx(0.5)
    assert out["pass@1"] == pytest.approx(0.5)
    assert out["pass@2"] == pytest.approx(2 / 3)
    assert out["maj@2"] == pytest.approx(2 / 3)
    assert out["questions"] == 3
    assert mean_at_n(verdicts) == pytest.approx(0.5)
    assert greedy_accuracy(verdicts) == pytest.approx(2 / 3)  # the first sample of each question


def test_breakdown_by_fields():
    verdicts = [[True], [False], [True]]
    answers = [["1"], ["2"], ["3"]]
    fields = [{"subject": "Algebra", "level": 1}, {"subject": "Algebra", "level": 2}, {"subject": "Geometry", "level": 2}]
    out = breakdown(verdicts, answers, fields, greedy=True)
    assert out["subject"]["Algebra"]["greedy_accuracy"] == pytest.approx(0.5)
    assert out["subject"]["Geometry"]["greedy_accuracy"] == 1.0
    assert out["level"]["2"]["questions"] == 2
