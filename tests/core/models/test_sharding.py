"""Logical axis rules -> NamedShardings, and sharded forward == unsharded forward."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from grpo_core.models import KVCache, QwenConfig, init_from_config
from grpo_core.sharding import (
    DEFAULT_RULES,
    logical_to_spec,
    named_sharding,
    param_shardings,
    shard_model,
    tree_shardings,
)
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

RULES = (
    ("vocab", "tp"),
    ("embed", "fsdp"),
    ("heads", "tp"),
    ("kv_heads", "tp"),
    ("mlp", "tp"),
    ("batch", ("dp", "fsdp")),
    ("norm", None),
    ("head_dim", None),
)
# Qwen3 with 4 heads / 2 kv heads: both divide tp=2; hidden 32 and vocab 128 divide 4 and 2.
CFG = QwenConfig.tiny("qwen3", tie_word_embeddings=False)

EXPECTED_SPECS = {
    "embed_tokens.embedding": P("tp", "fsdp"),
    "lm_head.kernel": P("fsdp", "tp"),
    "norm.scale": P(None),
    # Decoder layers are stacked over a leading `layers` axis, which no rule shards.
    "layers.input_layernorm.scale": P(None, None),
    "layers.self_attn.q_proj.kernel": P(None, "fsdp", "tp", None),
    "layers.self_attn.k_proj.kernel": P(None, "fsdp", "tp", None),
    "layers.self_attn.o_proj.kernel": P(None, "tp", None, "fsdp"),
    "layers.self_attn.q_norm.scale": P(None, None),
    "layers.mlp.gate_proj.kernel": P(None, "fsdp", "tp"),
    "layers.mlp.down_proj.kernel": P(None, "tp", "fsdp"),
}


def test_logical_to_spec_rules():
    assert logical_to_spec(("embed", "heads", "head_dim"), RULES) == P("fsdp", "tp", None)
    assert logical_to_spec(("batch", "length"), RULES) == P(("dp", "fsdp"), None)  # no rule -> replicated
    # A mesh axis shards at most one dimension: a second user with no other rule is an error...
    with pytest.raises(ValueError, match="dimension 'mlp' maps to mesh axis 'tp', which dimension 'vocab'"):
        logical_to_spec(("vocab", "mlp"), RULES)
    # ... unless it has a next rule with a free axis.
    assert logical_to_spec(("vocab", "mlp"), (("vocab", "tp"), ("mlp", "tp"), ("mlp", "fsdp"))) == P("tp", "fsdp")
    assert logical_to_spec((None, "embed"), RULES) == P(None, "fsdp")


def _flat(tree):
    return {".".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(tree)}


def test_param_shardings_follow_rules(mesh8):
    model = init_from_config(CFG)
    shardings = _flat(param_shardings(model, mesh8, RULES))
    for path, spec in EXPECTED_SPECS.items():
        assert shardings[path] == NamedSharding(mesh8, spec), path


def test_shard_model_places_params_and_matches_unsharded_forward(mesh8, randomize, left_padded, logits_of):
    model = randomize(init_from_config(CFG), seed=5)
    ids, mask = left_padded(CFG.vocab_size, 8, pads=(0, 1, 3, 6))  # batch 4 = dp * fsdp
    expected = logits_of(model, ids, mask)
    shard_model(model, mesh8, RULES)
    params = _flat(nnx.state(model))
    for path, spec in EXPECTED_SPECS.items():
        assert params[path].sharding.is_equivalent_to(NamedSharding(mesh8, spec), params[path].ndim), path
    batch = named_sharding(("batch", "length"), mesh8, RULES)
    got = logits_of(model, jax.device_put(ids, batch), jax.device_put(mask, batch))
    real = mask.astype(bool)
    assert np.abs(got - expected)[real].max() <= 1e-5


def test_indivisible_dimension_is_a_clear_error(mesh8):
    model = init_from_config(QwenConfig.tiny("qwen2", num_attention_heads=2, num_key_value_heads=1, head_dim=16))
    with pytest.raises(
        ValueError, match=r"self_attn\.k_proj\.\w+: dimension [12] of size 1 cannot be split over mesh axes tp"
    ):
        param_shardings(model, mesh8, RULES)


def test_rule_naming_an_absent_mesh_axis(mesh8):
    with pytest.raises(ValueError, match=r"mesh axes \['sp'\] that the mesh"):
        param_shardings(init_from_config(CFG), mesh8, (("embed", "sp"),))


def test_explicit_mesh_is_rejected_with_fix(mesh8):
    explicit = jax.make_mesh((1, 4, 2), ("dp", "fsdp", "tp"), axis_types=(jax.sharding.AxisType.Explicit,) * 3)
    with pytest.raises(ValueError, match="AxisType.Auto"):
        param_shardings(init_from_config(CFG), explicit, RULES)


def test_cache_logical_axes_give_batch_sharding(mesh8):
    shardings = tree_shardings(KVCache.logical_axes(), mesh8, DEFAULT_RULES)
    assert shardings.k.spec == P(None, ("dp", "fsdp"), None, "tp", None)
    assert shardings.mask.spec == P(("dp", "fsdp"), None)
    assert shardings.index.spec == P()
    cache = jax.device_put(init_from_config(CFG).init_cache(4, 8), shardings)
    assert cache.k.sharding == shardings.k and cache.k.dtype == jnp.float32
