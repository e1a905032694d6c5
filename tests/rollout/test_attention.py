"""The single-query decode attention equals the model's cached one-token forward."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_core.hlo import HloModule
from grpo_core.models import QwenConfig, init_from_config
from grpo_core.replica_groups import crosses_groups
from grpo_rollout.attention import decode_forward
from grpo_rollout.head_parallel import HeadParallel, grid_mesh
from grpo_rollout.model_parallel import ActivationLayout, model_parallel_layout


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


def split_layout(mesh, kind: str, slices: int):
    """The head- or model-parallel layout of 4 rows split over the mesh's dp and fsdp (tp replicates),
    the 8 devices as `slices` slices of consecutive devices (a slice's rows stay on its devices)."""
    if kind == "heads":
        return HeadParallel(grid_mesh(mesh, GEMMA.num_key_value_heads, slices))
    return model_parallel_layout(mesh, ("dp", "fsdp"), slices)


@pytest.mark.parametrize("slices", [1, 2])
@pytest.mark.parametrize("kind", ["heads", "model"])
def test_split_decode_steps_equal_the_model_step_of_gemma3(mesh, kind, slices):
    """Head-parallel: one row per row group, KV heads split over 2 devices; model-parallel: heads, MLP
    columns and vocabulary over the row devices (per slice across slices). Layer 1's keys come from a
    residual whose partial sums were added in another order: float32 rounding."""
    model, cache, tokens, live = prefilled(GEMMA)
    assert_step_equals_the_models(model, cache, tokens, live, split_layout(mesh, kind, slices), key_atol=1e-5)


@pytest.mark.parametrize("kind", ["heads", "model"])
def test_split_decode_steps_across_slices_keep_every_collective_within_a_slice(mesh, kind):
    """Devices 0-3 and 4-7 as two slices: the step's collectives (all-reduces, all-to-alls) group devices
    of one slice only; the same layout over the whole mesh groups devices of both (what the test tells apart)."""
    model, cache, tokens, live = prefilled(GEMMA)
    crosses = crosses_groups([0] * 4 + [1] * 4)  # partition i: the layout mesh's device i (batch order)

    def collectives(slices: int, where=None) -> int:
        step = jax.jit(lambda m, t, v, c: decode_forward(m, t, v, c, split_layout(mesh, kind, slices)))
        return sum(HloModule(step.lower(model, tokens, live, cache).compile().as_text())
                   .collective_count(where=where).values())

    assert collectives(2) > 0 and collectives(2, crosses) == 0
    assert collectives(1, crosses) > 0
