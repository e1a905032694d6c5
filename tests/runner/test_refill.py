"""Dynamic-sampling refill selection and merging, and the overlong reward, on hand-made inputs."""

import numpy as np
import pytest

from grpo_core.contracts import CompletionText
from grpo_core.rollout_records import RolloutResult, Sampled, Scores
from grpo_runner_gsm8k.tasks.rewards import OverlongOptions, overlong_penalty, overlong_reward
from grpo_runner_gsm8k.samplers.refill import merge_results, merge_scores, needs_more, pick_groups, refill_metrics

N = 2  # samples per prompt


def scores_of(totals) -> Scores:
    total = np.asarray(totals, np.float32)
    return Scores(total, {"correctness": total.copy()}, {"correctness": 1})


def result_of(prompts: int, prompt_width: int, tag: int) -> RolloutResult:
    """Rows whose completion ids are tag * 100 + row, so merged rows can be traced back."""
    rows = prompts * N
    ids = np.arange(rows)[:, None] + tag * 100 + np.zeros((1, 3), int)
    prompt = np.full((rows, prompt_width), 7, np.int32)
    return RolloutResult(prompt_ids=prompt, prompt_mask=np.ones_like(prompt), completion_ids=ids.astype(np.int32),
                         completion_mask=np.ones((rows, 3), np.int32), lengths=np.full(rows, 3, np.int32),
                         sampler_logps=np.full((rows, 3), -tag, np.float32), finished=np.ones(rows, bool),
                         num_prompts=prompts, n=N)


def rounds_of(*totals_and_widths) -> list[Sampled]:
    return [Sampled([f"r{i}p{g}" for g in range(len(totals) // N)], result_of(len(totals) // N, width, i),
                    scores_of(totals)) for i, (totals, width) in enumerate(totals_and_widths)]


def test_informative_groups_first_in_sampling_order_then_the_earliest_uninformative():
    # round 0: groups (1, 1) uninformative, (0, 1) informative; round 1: (0, 0) no, (1, 0) yes
    rounds = rounds_of(([1, 1, 0, 1], 4), ([0, 0, 1, 0], 4))
    assert pick_groups(rounds, N, 2) == [(0, 1), (1, 1)]
    assert pick_groups(rounds, N, 3) == [(0, 1), (1, 1), (0, 0)]
    assert pick_groups(rounds[:1], N, 2) == [(0, 1), (0, 0)]


def test_another_rollout_is_due_until_enough_groups_or_the_limit():
    one = rounds_of(([1, 1, 0, 1], 4))
    assert needs_more(one, N, 2, max_extra=1)
    assert not needs_more(one, N, 1, max_extra=1)
    two = rounds_of(([1, 1, 0, 1], 4), ([1, 1, 1, 1], 4))
    assert not needs_more(two, N, 2, max_extra=1)  # limit spent
    assert needs_more(two, N, 2, max_extra=2)


def test_merged_rows_come_from_the_picked_groups_with_prompts_left_padded():
    rounds = rounds_of(([1, 1, 0, 1], 3), ([0, 0, 1, 0], 5))
    picks = pick_groups(rounds, N, 2)
    merged = merge_results([r.result for r in rounds], picks, N)
    np.testing.assert_array_equal(merged.completion_ids[:, 0], [2, 3, 102, 103])
    assert merged.prompt_ids.shape == (4, 5) and merged.num_prompts == 2 and merged.n == N
    np.testing.assert_array_equal(merged.prompt_mask[:2], [[0, 0, 1, 1, 1]] * 2)  # round 0 padded on the left
    np.testing.assert_array_equal(merged.prompt_mask[2:], np.ones((2, 5)))
    np.testing.assert_array_equal(merged.sampler_logps[:, 0], [0, 0, -1, -1])
    scores = merge_scores([r.scores for r in rounds], picks, N)
    np.testing.assert_array_equal(scores.total, [0, 1, 1, 0])
    assert scores.errors == {"correctness": 2}


def test_refill_metrics_count_prompts_and_groups():
    rounds = rounds_of(([1, 1, 0, 1], 4), ([0, 0, 0, 0], 4))
    metrics = refill_metrics(rounds, pick_groups(rounds, N, 2), N)
    assert metrics == {"train-other/refill_extra_rollouts": 1, "train-other/refill_prompts_consumed": 4,
                       "train-other/refill_groups_dropped": 3, "train-other/refill_groups_missing": 1}


@pytest.mark.parametrize("tokens,expected", [(0, 0.0), (12, 0.0), (13, -0.25), (14, -0.5), (16, -1.0), (20, -1.0)])
def test_overlong_penalty_is_dapos_linear_ramp(tokens, expected):
    """L_max 16, L_cache 4: 0 up to 12 tokens, (12 - |y|) / 4 up to 16, -1 beyond."""
    assert overlong_penalty(tokens, 16, 4) == pytest.approx(expected)


def test_overlong_reward_reads_token_counts_and_the_rollout_budget():
    fn = overlong_reward(OverlongOptions(buffer=2))
    texts = [CompletionText("a", 1, 4, True), CompletionText("abc", 3, 4, True), CompletionText("abcd", 4, 4, False)]
    assert fn(texts, ["", "", ""]) == [0.0, -0.5, -1.0]
    assert overlong_reward(OverlongOptions(max_length=8, buffer=2))(texts, ["", "", ""]) == [0.0, 0.0, 0.0]
    assert overlong_penalty(1, 1, 4096) == -1.0  # a buffer longer than L_max is cut to it
    with pytest.raises(TypeError, match="CompletionText"):
        fn(["plain text"], [""])
