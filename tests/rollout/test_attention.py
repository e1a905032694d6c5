"""The single-query decode attention equals the model's cached one-token forward."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_core.models import QwenConfig, init_from_config
from grpo_rollout.attention import decode_forward
from grpo_rollout.head_parallel import HeadParallel, grid_mesh
from grpo_rollout.model_parallel import ActivationLayout


# Gemma 3: a 4-slot window on 6-slot prompts (rows 0 and 3 have real keys beyond it), sliding
# layers with their own RoPE base, a q scale other than head_dim ** -0.5, post-norms, scaled embeddings.
GEMMA = QwenConfig.tiny("gemma3_text", family_options=(("layer_types", ("sliding_attention", "full_attention")),
                                                       ("sliding_window", 4), ("rope_local_base_freq", 100.0),
                                                       ("query_pre_attn_scalar", 24)))
CONFIGS = {"qwen2": QwenConfig.tiny("qwen2"), "qwen3": QwenConfig.tiny("qwen3"), "gemma3_text": GEMMA}


def prefilled(config):
    """(model, cache of 4 left-padded prompts, tokens, live) for one decode step."""
    model = init_from_config(config, seed=2)
    ids = jax.random.randint(jax.random.key(0), (4, 6), 1, 128)
    mask = jnp.array([[1] * 6, [0, 0, 1, 1, 1, 1], [0] * 5 + [1], [0, 1, 1, 1, 1, 1]])
    _, cache = model(ids, attention_mask=mask, cache=model.init_cache(4, 9))
    return model, cache, jnp.array([3, 9, 27, 81]), jnp.array([True, True, False, True])


def assert_step_equals_the_models(model, cache, tokens, live, layout=ActivationLayout(), key_atol=1e-6):
    expected, expected_cache = model(tokens[:, None], attention_mask=live[:, None], cache=cache)
    hidden, new_cache = decode_forward(model, tokens, live, cache, layout)
    np.testing.assert_allclose(hidden, expected, atol=1e-5)
    np.testing.assert_array_equal(new_cache.mask, expected_cache.mask)
    assert int(new_cache.index) == int(expected_cache.index) == 7
    np.testing.assert_allclose(new_cache.k, expected_cache.k, atol=key_atol)


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_decode_forward_equals_the_model_step(family):
    assert_step_equals_the_models(*prefilled(CONFIGS[family]))


def test_head_parallel_decode_step_equals_the_model_step_of_gemma3(mesh):
    """One row per row group, KV heads split over 2 devices (grpo_rollout.head_parallel). Layer 1's
    keys come from a residual whose partial sums were added in another order: float32 rounding."""
    model, cache, tokens, live = prefilled(GEMMA)
    layout = HeadParallel(grid_mesh(mesh, GEMMA.num_key_value_heads))
    assert_step_equals_the_models(model, cache, tokens, live, layout, key_atol=1e-5)
