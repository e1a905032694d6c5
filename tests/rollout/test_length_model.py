"""The geometric length model: the stop token has probability p at every step."""

import jax
import numpy as np
import pytest

from grpo_core.contracts import Policy, SamplingParams
from grpo_core.models import QwenConfig, init_from_config
from grpo_rollout import JaxRollout
from grpo_rollout.length_model import geometric_stop_model

VOCAB, STOP = 97, 5


def tiny_model(tied: bool = False):
    cfg = QwenConfig(model_type="qwen2", vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied,
                     max_position_embeddings=256, rope_theta=10_000.0)
    return init_from_config(cfg, seed=0)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_stop_probability_is_p_after_any_context(temperature):
    model = geometric_stop_model(tiny_model(), STOP, 0.125, temperature)
    ids = jax.random.randint(jax.random.key(1), (3, 9), 0, VOCAB)
    logits = model.logits(model(ids)) / temperature  # [3, 9, V]
    np.testing.assert_allclose(np.exp(jax.nn.log_softmax(logits)[..., STOP]), 0.125, rtol=1e-5)


def test_sampled_lengths_are_geometric():
    """512 rows, at most 64 tokens, p = 1/8. Every sampled token is a Bernoulli(p) stop trial,
    so stops / tokens estimates p with standard error sqrt(p (1 - p) / tokens) ~ 0.005 at
    ~4,000 tokens: 0.02 is four of them. The mean of min(Geometric(p), 64) is
    (1 - (1 - p)^64) / p = 7.9993 with standard error ~ 7.5 / sqrt(512) = 0.33: 1.3 is four."""
    p, rows, cap = 0.125, 512, 64
    rollout = JaxRollout()
    rollout.load_weights(Policy.of(geometric_stop_model(tiny_model(), STOP, p)))
    sampling = SamplingParams(max_new_tokens=cap, n=rows, stop_token_ids=(STOP,))
    result = rollout.generate([[1, 2, 3]], jax.random.key(0), sampling)
    lengths, stopped = np.asarray(result.lengths), np.asarray(result.finished)
    assert abs(stopped.sum() / lengths.sum() - p) < 0.02
    assert abs(lengths.mean() - (1 - (1 - p) ** cap) / p) < 1.3
    assert np.all(lengths[~stopped] == cap)


def test_a_tied_head_or_a_bad_p_is_refused():
    with pytest.raises(ValueError, match="untied"):
        geometric_stop_model(tiny_model(tied=True), STOP, 0.1)
    with pytest.raises(ValueError, match="p=1.5"):
        geometric_stop_model(tiny_model(), STOP, 1.5)
