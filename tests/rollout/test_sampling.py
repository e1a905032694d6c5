"""The one-uniform inverse-CDF sampler: distribution, support of top-k / top-p, logps."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_rollout.sampling import (SamplingParams, cdf_block_size, nucleus_keep_sorted, nucleus_threshold,
                                   sample_next)

VOCAB = 24
DRAWS = 40_000


def small_logits(seed=0, scale=1.5):
    return jax.random.normal(jax.random.key(seed), (VOCAB,)) * scale


def draw(logits, params, draws=DRAWS, **kwargs):
    """Sample `draws` rows of the same logits [V] -> (tokens [draws], logps [draws])."""
    batch = jnp.broadcast_to(logits, (draws, logits.shape[0]))
    uniforms = jax.random.uniform(jax.random.key(123), (draws,))
    return jax.jit(lambda b, u: sample_next(b, u, params, **kwargs))(batch, uniforms)


def chi_square(tokens, probs):
    """Pearson statistic of observed token counts against probs (cells with p > 0)."""
    counts = np.bincount(np.asarray(tokens), minlength=probs.shape[0])
    expected = probs * len(tokens)
    support = expected > 0
    assert counts[~support].sum() == 0, "sampled a token of probability 0"
    return float(((counts[support] - expected[support]) ** 2 / expected[support]).sum()), int(support.sum())


def assert_matches(tokens, probs):
    stat, cells = chi_square(tokens, probs)
    # df <= 23: the 1e-6 tail quantile is below 70; an off-by-one or wrong temperature
    # sampler gives statistics in the hundreds or thousands with 40k draws.
    assert stat < 70, f"chi-square {stat:.1f} over {cells} cells: sampler does not follow the distribution"


@pytest.mark.parametrize("block", [None, 5, 7])  # divisor, divisor, padded tail (24 = 3*7 + 3)
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_full_vocab_sampler_follows_softmax(block, temperature):
    logits = small_logits()
    tokens, _ = draw(logits, SamplingParams(1, temperature=temperature), block=block)
    assert_matches(tokens, np.asarray(jax.nn.softmax(logits / temperature)))


def test_a_wrong_distribution_fails_the_check():
    logits = small_logits()
    tokens, _ = draw(logits, SamplingParams(1, temperature=0.7))
    with pytest.raises(AssertionError):
        assert_matches(tokens, np.asarray(jax.nn.softmax(logits)))


def test_top_k_samples_renormalised_top_k():
    logits = small_logits(1)
    tokens, _ = draw(logits, SamplingParams(1, top_k=5))
    keep = np.zeros(VOCAB, bool)
    keep[np.argsort(-np.asarray(logits))[:5]] = True
    probs = np.where(keep, np.exp(np.asarray(logits)), 0.0)
    assert_matches(tokens, probs / probs.sum())


def nucleus_probs(logits, top_p):
    probs = np.asarray(jax.nn.softmax(logits), np.float64)
    order = np.argsort(-probs)
    exclusive = np.cumsum(probs[order]) - probs[order]
    keep = np.zeros_like(probs, bool)
    keep[order[exclusive < top_p]] = True
    kept = np.where(keep, probs, 0.0)
    return kept / kept.sum()


@pytest.mark.parametrize("candidates", [256, 3])  # nucleus among candidates / exact fallback
def test_top_p_samples_the_nucleus(candidates):
    logits = small_logits(2)
    expected = nucleus_probs(logits, 0.8)
    assert 3 < (expected > 0).sum() < VOCAB  # the fallback path is really taken with 3 candidates
    tokens, _ = draw(logits, SamplingParams(1, top_p=0.8), top_p_candidates=candidates)
    assert_matches(tokens, expected)


def test_top_k_then_top_p_restricts_to_both():
    logits = small_logits(3)
    tokens, _ = draw(logits, SamplingParams(1, top_k=6, top_p=0.5), draws=5000)
    top6 = np.argsort(-np.asarray(logits))[:6]
    probs = np.asarray(jax.nn.softmax(logits[top6]))
    exclusive = np.cumsum(probs) - probs
    allowed = set(top6[exclusive < 0.5].tolist())
    assert set(np.unique(np.asarray(tokens)).tolist()) <= allowed


def test_top_k_one_and_greedy_pick_the_first_maximum():
    logits = jnp.array([[0.0, 3.0, 1.0, 3.0], [2.0, -1.0, 2.0, 0.5]])
    uniforms = jnp.array([0.99, 0.01])
    greedy, _ = sample_next(logits, uniforms, SamplingParams(1, greedy=True), block=2)
    top1, _ = sample_next(logits, uniforms, SamplingParams(1, top_k=1))
    assert greedy.tolist() == [1, 0] and top1.tolist() == [1, 0]


@pytest.mark.parametrize("params", [
    SamplingParams(1, temperature=0.7), SamplingParams(1, temperature=0.7, top_k=4),
    SamplingParams(1, temperature=0.7, top_p=0.6), SamplingParams(1, temperature=0.7, greedy=True)])
def test_logps_are_unfiltered_log_softmax_at_temperature(params):
    logits = jax.random.normal(jax.random.key(4), (16, VOCAB)) * 2
    tokens, logps = sample_next(logits, jax.random.uniform(jax.random.key(5), (16,)), params)
    expected = jnp.take_along_axis(jax.nn.log_softmax(logits / 0.7), tokens[:, None], 1)[:, 0]
    np.testing.assert_allclose(logps, expected, atol=1e-5)


def test_filtered_logps_are_of_the_renormalised_top_k():
    logits = jax.random.normal(jax.random.key(6), (16, VOCAB))
    params = SamplingParams(1, top_k=4, filtered_logps=True)
    tokens, logps = sample_next(logits, jax.random.uniform(jax.random.key(7), (16,)), params)
    values, indices = jax.lax.top_k(logits, 4)
    filtered = jax.nn.log_softmax(values)
    expected = jnp.sum(jnp.where(indices == tokens[:, None], filtered, 0.0), axis=1)
    np.testing.assert_allclose(logps, expected, atol=1e-5)


def test_nucleus_threshold_agrees_with_the_sorted_rule():
    weights = jax.random.uniform(jax.random.key(8), (6, 50)) ** 4
    budget = 0.7 * weights.sum(1)
    threshold = nucleus_threshold(weights, budget)
    order = jnp.argsort(-weights, axis=1)
    sorted_w = jnp.take_along_axis(weights, order, 1)
    keep_sorted = nucleus_keep_sorted(sorted_w, budget)
    keep = jnp.zeros_like(keep_sorted).at[jnp.arange(6)[:, None], order].set(keep_sorted)
    assert bool(jnp.all(keep == (weights >= threshold[:, None])))


def test_ties_at_the_nucleus_boundary_are_all_kept():
    sorted_w = jnp.array([[0.4, 0.2, 0.2, 0.2]])
    keep = nucleus_keep_sorted(sorted_w, jnp.array([0.5]))
    assert keep.tolist() == [[True, True, True, True]]


def test_block_size_prefers_a_divisor_near_sqrt():
    assert 151936 % cdf_block_size(151936) == 0
    assert cdf_block_size(97) >= 1  # prime: falls back to a padded power of two
    assert 152064 % cdf_block_size(152064) == 0


@pytest.mark.parametrize("kwargs, field", [
    (dict(max_new_tokens=0), "max_new_tokens"), (dict(max_new_tokens=4, temperature=0.0), "temperature"),
    (dict(max_new_tokens=4, top_p=0.0), "top_p"), (dict(max_new_tokens=4, top_k=-1), "top_k"),
    (dict(max_new_tokens=4, n=0), "n")])
def test_invalid_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)
