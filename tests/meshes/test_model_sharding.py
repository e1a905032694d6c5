"""The strategies' rules applied to a tiny Qwen model: parameter placement, and a
sharded forward pass that matches the single-device one."""

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

models = pytest.importorskip("grpo_core.models")
sharding = pytest.importorskip("grpo_core.sharding")
from flax import nnx  # noqa: E402  (flax comes with grpo_core.models)

from grpo_core.config import MeshConfig  # noqa: E402
from grpo_meshes import (  # noqa: E402
    build_mesh_from_config,
    global_batch,
    rollout_activation_rules,
    train_batch_sharding,
)

TINY = dict(vocab_size=64, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2)

EXPECTED_SPECS = {  # (module, parameter) -> spec under the param rules
    ("embed_tokens", "embedding"): P("tp", "fsdp"),          # [vocab, embed]
    # Decoder-layer parameters are stacked over a leading, unsharded `layers` axis.
    ("q_proj", "kernel"): P(None, "fsdp", "tp", None),        # [layers, embed, heads, head_dim]
    ("q_proj", "bias"): P(None, "tp", None),                  # [layers, heads, head_dim]
    ("k_proj", "kernel"): P(None, "fsdp", "tp", None),        # [layers, embed, kv_heads, head_dim]
    ("o_proj", "kernel"): P(None, "tp", None, "fsdp"),        # [layers, heads, head_dim, embed]
    ("gate_proj", "kernel"): P(None, "fsdp", "tp"),           # [layers, embed, mlp]
    ("down_proj", "kernel"): P(None, "tp", "fsdp"),           # [layers, mlp, embed]
    ("input_layernorm", "scale"): P(None, None),              # [layers, norm]
    ("q_norm", "scale"): P(None, None),
    ("lm_head", "kernel"): P("fsdp", "tp"),                   # [embed, vocab]
}


def tiny_model(model_type="qwen2", tied=True):
    cfg = models.QwenConfig(model_type=model_type, tie_word_embeddings=tied, **TINY)
    return models.init_from_config(cfg, seed=0)


def resolve(strategy, **options):
    return build_mesh_from_config(MeshConfig(strategy=strategy, options=options))


def flat_specs(model, mesh, rules):
    state = sharding.param_shardings(model, mesh, rules)
    return {tuple(str(p) for p in path[-2:]): variable.get_value().spec
            for path, variable in nnx.to_flat_state(state)}


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3"])
def test_params_get_the_expected_shardings(model_type):
    strategy, mesh = resolve("1,-1,2")
    specs = flat_specs(tiny_model(model_type, tied=False), mesh, strategy.param_rules)
    checked = {key: specs[key] for key in EXPECTED_SPECS if key in specs}
    assert checked == {key: EXPECTED_SPECS[key] for key in checked}
    assert ("lm_head", "kernel") in checked and ("embed_tokens", "embedding") in checked
    assert (("q_norm", "scale") in checked) == (model_type == "qwen3")
    assert (("q_proj", "bias") in checked) == (model_type == "qwen2")


def test_sharded_params_are_split_over_fsdp_and_tp():
    strategy, mesh = resolve("fsdp_tp", tp=2)  # fsdp=4, tp=2
    model = sharding.shard_model(tiny_model(), mesh, strategy.param_rules)
    embedding = model.embed_tokens.embedding.get_value()  # [64, 64] over (tp, fsdp)
    assert {shard.data.shape for shard in embedding.addressable_shards} == {(32, 16)}
    gate = model.layers.mlp.gate_proj.kernel.get_value()  # [L, 64, 192] over (None, fsdp, tp)
    assert {shard.data.shape for shard in gate.addressable_shards} == {(gate.shape[0], 16, 96)}


def forward_fn(model):
    graphdef, state = nnx.split(model)

    @jax.jit
    def forward(state, ids, mask):
        return nnx.merge(graphdef, state)(ids, attention_mask=mask)

    return lambda ids, mask: forward(state, ids, mask)


def token_batch():
    rng = np.random.default_rng(0)
    ids = rng.integers(0, TINY["vocab_size"], size=(8, 6), dtype=np.int32)
    mask = np.ones((8, 6), np.int32)
    mask[::2, :2] = 0  # left padding on every other row
    return ids, mask


@pytest.mark.parametrize("strategy, options", [
    ("auto", {}), ("host_local", {}), ("2,2,2", {}), ("fsdp_tp", {"tp": 2}),
])
def test_sharded_forward_equals_unsharded(strategy, options):
    ids, mask = token_batch()
    expected = np.asarray(forward_fn(tiny_model())(ids, mask))  # [B, T, H] on one device
    resolved = resolve(strategy, **options)
    model = sharding.shard_model(tiny_model(), resolved.mesh, resolved.strategy.param_rules)
    batch_sharding = train_batch_sharding(resolved.mesh)
    hidden = forward_fn(model)(*global_batch((ids, mask), batch_sharding))
    assert len(hidden.sharding.device_set) == 8
    np.testing.assert_allclose(np.asarray(hidden), expected, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("style, kv_spec", [
    ("legacy", P(None, ("dp", "fsdp", "tp"), None, None, None)),
    ("maxtext", P(None, ("dp",), None, "tp", None)),
])
def test_kv_cache_follows_the_rollout_style(style, kv_spec):
    mesh = resolve("2,2,2").mesh
    shardings = sharding.tree_shardings(models.KVCache.logical_axes(), mesh, rollout_activation_rules(style))
    assert shardings.k.spec == kv_spec and shardings.v.spec == kv_spec


def test_activation_rules_give_batch_and_head_splits():
    strategy = resolve("2,2,2").strategy
    to_spec = sharding.logical_to_spec
    assert to_spec(("batch", "length", "embed"), strategy.activation_rules) == P(("dp", "fsdp"), None, None)
    assert to_spec(("batch", "length", "heads", "head_dim"), strategy.activation_rules) == P(
        ("dp", "fsdp"), None, "tp", None)
    assert to_spec(("batch", "length", "vocab"), rollout_activation_rules("legacy")) == P(
        ("dp", "fsdp", "tp"), None, None)
