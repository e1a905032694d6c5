"""End-to-end generation with the `jax` backend on random tiny Qwen models."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_core.contracts import Policy
from grpo_core.models import QwenConfig, init_from_config
from grpo_rollout import JaxRollout, JaxRolloutOptions, SamplingParams

PROMPTS = [[5, 17, 33, 2, 91], [64, 3], [7, 7, 120, 45, 12, 99, 1, 30, 4, 4, 9]]
# About one token in sixteen stops a row: some rows end early, some run to the end.
STOP_IDS = tuple(range(100, 108))
ROLLOUT = JaxRollout(JaxRolloutOptions(prompt_buckets=(8, 16)))


@pytest.fixture(scope="module", params=["qwen2", "qwen3"])
def model(request):
    return init_from_config(QwenConfig.tiny(request.param, tie_word_embeddings=request.param == "qwen3"), seed=3)


def generate(model, params, seed=0, prompts=PROMPTS):
    ROLLOUT.load_weights(Policy.of(model))
    return ROLLOUT.generate(prompts, jax.random.key(seed), params, pad_token_id=0)


def full_forward_logps(model, batch, temperature):
    """log_softmax(logits / T) of every token given the tokens before it [N, T] (column 0: 0)."""
    hidden = model(batch.input_ids, attention_mask=batch.attention_mask)
    logp = jax.nn.log_softmax(model.logits(hidden)[:, :-1] / temperature, axis=-1)
    taken = jnp.take_along_axis(logp, batch.input_ids[:, 1:, None], axis=-1)[..., 0]
    return jnp.pad(taken, ((0, 0), (1, 0)))


def test_sampler_logps_equal_full_forward_logps(model):
    params = SamplingParams(max_new_tokens=10, n=2, temperature=0.7, stop_token_ids=STOP_IDS)
    result = generate(model, params)
    assert 0 < int(result.finished.sum()) < len(result.finished)  # both kinds of rows are covered
    batch = ROLLOUT.trim(result)
    expected = full_forward_logps(model, batch, 0.7)
    mask = np.asarray(batch.completion_mask, bool)
    np.testing.assert_allclose(np.asarray(batch.sampler_logps)[mask], np.asarray(expected)[mask], atol=1e-5)


def test_a_stop_token_ends_the_row_and_masks_the_rest(model):
    params = SamplingParams(max_new_tokens=10, n=2, stop_token_ids=STOP_IDS)
    result = generate(model, params, seed=1)
    tokens, mask = np.asarray(result.completion_ids), np.asarray(result.completion_mask)
    for row, length in enumerate(np.asarray(result.lengths)):
        assert mask[row].tolist() == [1] * length + [0] * (10 - length)
        stops = np.isin(tokens[row, :length], STOP_IDS)
        if result.finished[row]:
            assert stops[-1] and not stops[:-1].any()  # the stop token is the last one, and counted
        else:
            assert length == 10 and not stops.any()
        assert (tokens[row, length:] == 0).all() and (np.asarray(result.sampler_logps)[row, length:] == 0).all()


def test_the_same_key_reproduces_the_rollout_and_another_key_does_not(model):
    params = SamplingParams(max_new_tokens=8, n=2)
    first, again, other = generate(model, params, 5), generate(model, params, 5), generate(model, params, 6)
    np.testing.assert_array_equal(first.completion_ids, again.completion_ids)
    np.testing.assert_array_equal(first.sampler_logps, again.sampler_logps)
    assert not np.array_equal(first.completion_ids, other.completion_ids)


def test_samples_of_one_prompt_form_a_group(model):
    result = generate(model, SamplingParams(max_new_tokens=6, n=3))
    assert result.completion_ids.shape == (9, 6) and result.group_ids.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    prompts = np.asarray(result.prompt_ids)
    assert (prompts[0] == prompts[2]).all() and not (prompts[0] == prompts[3]).all()
    assert len({tuple(r) for r in np.asarray(result.completion_ids)[:3]}) > 1  # K different samples


def test_top_k_one_equals_greedy(model):
    greedy = generate(model, SamplingParams(max_new_tokens=8, greedy=True, stop_token_ids=STOP_IDS))
    top1 = generate(model, SamplingParams(max_new_tokens=8, top_k=1, stop_token_ids=STOP_IDS), seed=9)
    np.testing.assert_array_equal(greedy.completion_ids, top1.completion_ids)
    np.testing.assert_array_equal(greedy.completion_mask, top1.completion_mask)


def test_greedy_does_not_depend_on_padding_or_batch_mates(model):
    params = SamplingParams(max_new_tokens=8, greedy=True)
    alone = generate(model, params, prompts=[PROMPTS[1]])  # width 8
    in_batch = generate(model, params)  # width 16 (the 11-token prompt)
    assert alone.prompt_ids.shape[1] == 8 and in_batch.prompt_ids.shape[1] == 16
    np.testing.assert_array_equal(alone.completion_ids[0], in_batch.completion_ids[1])


def test_a_prompt_longer_than_the_buckets_is_a_clear_error(model):
    with pytest.raises(ValueError, match="largest prompt bucket 16"):
        generate(model, SamplingParams(max_new_tokens=2), prompts=[list(range(1, 20))])


def test_pre_padded_arrays_are_refitted_to_the_bucket(model):
    params = SamplingParams(max_new_tokens=8, n=2)
    width = 40  # wider than needed: all-pad columns are dropped, the batch lands in bucket 16
    ids = np.zeros((len(PROMPTS), width), np.int32)
    for row, prompt in enumerate(PROMPTS):
        ids[row, width - len(prompt):] = prompt
    ROLLOUT.load_weights(Policy.of(model))
    result = ROLLOUT.generate_padded(ids, (ids > 0).astype(np.int32), jax.random.key(0), params, pad_token_id=0)
    expected = generate(model, params)
    assert result.prompt_ids.shape[1] == 16
    np.testing.assert_array_equal(result.completion_ids, expected.completion_ids)
