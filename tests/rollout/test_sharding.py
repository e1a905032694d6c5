"""Rollout under an 8-device mesh (fake CPU devices from tests/conftest.py) equals the
unsharded rollout, for both batch sharding styles."""

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from grpo_core.models import QwenConfig, init_from_config
from grpo_core.sharding import DEFAULT_RULES, shard_model
from grpo_rollout import JaxRollout, JaxRolloutOptions, SamplingParams

PROMPTS = [[5, 17, 33, 2, 91], [64, 3], [7, 7, 120, 45, 12, 99, 1, 30], [88, 1]]
PARAMS = SamplingParams(max_new_tokens=8, n=2, temperature=0.9, stop_token_ids=tuple(range(100, 108)))
ROLLOUT = JaxRollout(JaxRolloutOptions(prompt_buckets=(8,)))
STYLES = {"legacy": ("dp", "fsdp", "tp"), "maxtext": "dp"}


def sample(model, prompts, key, batch_sharding=None):
    ROLLOUT.load_weights(model)
    return ROLLOUT.generate(prompts, key, PARAMS, batch_sharding=batch_sharding)


@pytest.fixture(scope="module")
def mesh():
    if jax.device_count() < 8:
        pytest.skip("needs 8 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    return Mesh(np.asarray(jax.devices()[:8]).reshape(2, 2, 2), ("dp", "fsdp", "tp"))


@pytest.fixture(scope="module")
def models(mesh):
    cfg = QwenConfig.tiny("qwen2", tie_word_embeddings=False)
    plain = init_from_config(cfg, seed=1)
    sharded = shard_model(nnx.clone(init_from_config(cfg, seed=1)), mesh, DEFAULT_RULES)
    return plain, sharded


@pytest.mark.parametrize("style", sorted(STYLES))
def test_sharded_rollout_equals_unsharded(models, mesh, style):
    plain, sharded = models
    batch_sharding = NamedSharding(mesh, PartitionSpec(STYLES[style]))
    expected = sample(plain, PROMPTS, jax.random.key(7))
    result = sample(sharded, PROMPTS, jax.random.key(7), batch_sharding=batch_sharding)
    assert result.completion_ids.sharding.spec[0] == STYLES[style]
    np.testing.assert_array_equal(result.completion_ids, expected.completion_ids)
    np.testing.assert_array_equal(result.completion_mask, expected.completion_mask)
    np.testing.assert_allclose(result.sampler_logps, expected.sampler_logps, atol=1e-5)
    assert 0 < int(expected.finished.sum()) < 8


def test_a_batch_that_does_not_split_over_the_devices_is_a_clear_error(models, mesh):
    batch_sharding = NamedSharding(mesh, PartitionSpec(STYLES["legacy"]))
    with pytest.raises(ValueError, match="multiple of 8"):
        sample(models[1], PROMPTS[:3], jax.random.key(0), batch_sharding=batch_sharding)
