"""Shared-prompt decode (grpo_rollout.cascade) samples what the repeated-prompt decode samples:
the same tokens and log-probs within 1e-5 (f32), on qwen2 and qwen3, greedy and sampled, with
per-token LoRA, and on 8 devices for the gathered, sharded and model-parallel layouts."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from grpo_core.contracts import Policy
from grpo_core.testing import assert_same_rollout, with_random_adapters
from grpo_core.models import QwenConfig, init_from_config
from grpo_core.sharding import DEFAULT_RULES, shard_model
from grpo_rollout import JaxRollout, JaxRolloutOptions, SamplingParams
from grpo_rollout.attention import decode_attention
from grpo_rollout.cascade import cascade_attention
from grpo_rollout.decode import prefill, prefill_shared

PROMPTS = [[5, 17, 33, 2, 91], [64, 3], [7, 7, 120, 45, 12, 99, 1, 30], [88, 1]]
STOP_IDS = tuple(range(100, 108))  # about one token in sixteen ends a row
SAMPLED = SamplingParams(max_new_tokens=6, n=2, temperature=0.9, stop_token_ids=STOP_IDS)
GREEDY = SamplingParams(max_new_tokens=6, n=2, greedy=True)
LAYOUTS = {"gathered": True, "sharded": False, "model_parallel": "model_parallel", "head_parallel": "head_parallel"}


def rollouts(**options):
    """(shared, repeated) backends with otherwise equal options."""
    return tuple(JaxRollout(JaxRolloutOptions(prompt_buckets=(8,), shared_prompt=shared, **options))
                 for shared in (True, False))


def assert_same_samples(model, rollout_pair, params, batch_sharding=None, seed=7):
    results = []
    for rollout in rollout_pair:
        rollout.load_weights(Policy.of(model))
        results.append(rollout.generate(PROMPTS, jax.random.key(seed), params, batch_sharding=batch_sharding))
    shared, repeated = results
    assert_same_rollout(shared, repeated)
    return shared


def test_cascade_attention_equals_attention_over_the_repeated_prompt_and_completion():
    """Random f32 inputs: 3 groups of 4 rows, 8 query heads over 2 KV heads; one row sees no
    completion slot (its first step), the merged softmax still equals the joint one."""
    keys = jax.random.split(jax.random.key(0), 5)
    groups, n, heads, kv, dim, prompt_len, own_len = 3, 4, 8, 2, 16, 7, 5
    q = jax.random.normal(keys[0], (groups * n, heads, dim))
    prompt_k, prompt_v = (jax.random.normal(k, (groups, prompt_len, kv, dim)) for k in keys[1:3])
    own_k, own_v = (jax.random.normal(k, (groups * n, own_len, kv, dim)) for k in keys[3:5])
    prompt_visible = jnp.arange(prompt_len)[None, :] >= jnp.array([[2], [0], [5]])  # left padding
    own_visible = jnp.arange(own_len)[None, :] < (jnp.arange(groups * n) % own_len)[:, None]
    merged = cascade_attention(q, prompt_k, prompt_v, prompt_visible, own_k, own_v, own_visible)
    repeat = lambda a: jnp.repeat(a, n, axis=0)  # noqa: E731
    joint = decode_attention(q, jnp.concatenate([repeat(prompt_k), own_k], 1),
                             jnp.concatenate([repeat(prompt_v), own_v], 1),
                             jnp.concatenate([repeat(prompt_visible), own_visible], 1))
    np.testing.assert_allclose(merged, joint, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3"])
def test_shared_prompt_samples_the_repeated_prompts_tokens(model_type):
    model = init_from_config(QwenConfig.tiny(model_type, tie_word_embeddings=model_type == "qwen3"), seed=3)
    pair = rollouts()
    assert pair[0].prefill_phase(SAMPLED) is prefill_shared and pair[1].prefill_phase(SAMPLED) is prefill
    sampled = assert_same_samples(model, pair, SAMPLED)
    assert 0 < int(sampled.finished.sum()) < len(sampled.finished)  # stopped and running rows both covered
    assert_same_samples(model, pair, GREEDY)


def test_shared_prompt_with_per_token_lora_adapters():
    model = with_random_adapters(init_from_config(QwenConfig.tiny("qwen3"), seed=4))
    assert all(float(jnp.abs(b.get_value()).max()) > 0 for path, b in nnx.to_flat_state(nnx.state(model, nnx.LoRAParam))
               if path[-1] == "b")
    assert_same_samples(model, rollouts(), SAMPLED)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_shared_prompt_equals_repeated_prompt_in_every_decode_layout(mesh, layout):
    """4 prompts x 2 samples over 8 devices: the prompt cache [4, ...] does not split 8 ways and is
    replicated beside rows split 8 ways. Sampled only (greedy is covered unsharded above)."""
    cfg = QwenConfig.tiny("qwen2", tie_word_embeddings=False, num_attention_heads=8, hidden_size=64)
    sharded = shard_model(init_from_config(cfg, seed=3), mesh, DEFAULT_RULES)
    batch_sharding = NamedSharding(mesh, PartitionSpec(("dp", "fsdp", "tp")))
    pair = rollouts(gather_weights=LAYOUTS[layout])
    shared = assert_same_samples(sharded, pair, SAMPLED, batch_sharding)
    assert shared.completion_ids.sharding.spec[0] == ("dp", "fsdp", "tp")
