"""Prompt buckets, left padding, and cutting the training batch to its real length."""

import jax.numpy as jnp
import numpy as np
import pytest

from grpo_rollout.prompts import bucket_length, check_left_padded, fit_to_bucket, left_pad, repeat_samples
from grpo_core.rollout_records import RolloutResult, trim_batch, trimmed_widths


def test_left_pad_rounds_up_to_the_bucket():
    ids, mask = left_pad([[1, 2, 3], [4]], pad_id=9, buckets=(2, 4, 8))
    assert ids.tolist() == [[9, 1, 2, 3], [9, 9, 9, 4]]
    assert mask.tolist() == [[0, 1, 1, 1], [0, 0, 0, 1]]


def test_prompt_longer_than_every_bucket_is_an_error():
    with pytest.raises(ValueError, match="largest prompt bucket 8"):
        bucket_length(9, (4, 8))


def test_max_prompt_length_and_empty_prompts_are_errors():
    with pytest.raises(ValueError, match="max_prompt_length=2"):
        left_pad([[1, 2, 3]], 0, max_prompt_length=2)
    with pytest.raises(ValueError, match="at least one token"):
        left_pad([[1], []], 0)


def test_fit_to_bucket_drops_all_pad_columns_and_repads():
    ids = np.array([[0, 0, 0, 0, 0, 5, 6], [0, 0, 0, 0, 7, 8, 9]])
    mask = (ids > 0).astype(np.int32)
    new_ids, new_mask = fit_to_bucket(ids, mask, pad_id=0, buckets=(4, 8))
    assert new_ids.tolist() == [[0, 0, 5, 6], [0, 7, 8, 9]]
    assert new_mask.sum() == mask.sum()


def test_right_padded_prompts_are_rejected():
    with pytest.raises(ValueError, match="not left-padded"):
        check_left_padded(np.array([[1, 1, 0]]))


def test_repeat_samples_groups_copies_of_a_prompt():
    assert repeat_samples(np.array([[1], [2]]), 3)[:, 0].tolist() == [1, 1, 1, 2, 2, 2]


@pytest.mark.parametrize("prompt_len, completion_len, expected", [
    (5, 3, (5, 11)),     # total 8 -> 16: the extra columns go to the completion side
    (5, 20, (5, 27)),    # 25 -> 32, completion widens to 27 (cap 32)
    (40, 30, (40, 32)),  # 70 -> 80 would pass the caps: capped at 40 + 32
])
def test_trimmed_widths(prompt_len, completion_len, expected):
    prompt_w, completion_w = trimmed_widths(prompt_len, completion_len, 40, 32, 16)
    assert (prompt_w, completion_w) == expected
    assert prompt_w >= prompt_len and completion_w >= completion_len


def fake_result():
    prompt_ids = jnp.array([[0, 0, 0, 0, 0, 0, 3, 4], [0, 0, 0, 0, 0, 7, 8, 9]])
    completion_ids = jnp.array([[11, 12, 0, 0, 0, 0], [13, 0, 0, 0, 0, 0]])
    completion_mask = (jnp.arange(6)[None] < jnp.array([[2], [1]])).astype(jnp.int32)
    return RolloutResult(
        prompt_ids=prompt_ids, prompt_mask=(prompt_ids > 0).astype(jnp.int32), completion_ids=completion_ids,
        completion_mask=completion_mask, lengths=completion_mask.sum(1),
        sampler_logps=-0.5 * completion_mask.astype(jnp.float32), finished=jnp.array([True, True]),
        num_prompts=2, n=1)


def test_trim_batch_keeps_every_real_token_aligned():
    batch = trim_batch(fake_result(), bucket=4)
    # real prompt 3 + completion 2 = 5 -> 8 columns: prompt 3 (+0), completion 5 (capped at 6)
    assert batch.input_ids.shape == (2, 8) and batch.prompt_width == 3
    assert batch.input_ids.tolist() == [[0, 3, 4, 11, 12, 0, 0, 0], [7, 8, 9, 13, 0, 0, 0, 0]]
    assert batch.attention_mask.tolist() == [[0, 1, 1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 0, 0, 0, 0]]
    assert batch.completion_mask.tolist() == [[0, 0, 0, 1, 1, 0, 0, 0], [0, 0, 0, 1, 0, 0, 0, 0]]
    assert float(batch.sampler_logps.sum()) == pytest.approx(-1.5)
