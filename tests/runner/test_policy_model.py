"""The policy model (grpo_runner_gsm8k.assembly.policy) against a direct computation: the full-parameter
model's forward weights are the masters cast to the compute dtype (or the masters themselves
when stored so) and its reference is a separate copy of them; the LoRA model's merged forward
weights are grpo_core.models.lora.merged_state of base and adapters; the abstract forward
weights the plan reads have the real ones' shapes, dtypes and shardings."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from grpo_core.models import QwenConfig, init_from_config, lora
from grpo_core.models.precision import cast_floating
from grpo_core.sharding import per_device_bytes, shard_model
from grpo_meshes import MeshStrategy
from grpo_runner_gsm8k.assembly.policy import FullPolicy, policy_model

QCFG = QwenConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, tie_word_embeddings=True)
FSDP8 = MeshStrategy("fsdp8", (1, 8, 1))


def built_policy(cfg, compute_dtype):
    mesh = FSDP8.build_mesh()
    model = shard_model(init_from_config(QCFG, seed=0), mesh, FSDP8.param_rules)
    return policy_model(cfg.model, model, mesh, FSDP8.param_rules, compute_dtype)


def abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


def same_layout(abstract_tree, real_tree) -> bool:
    """Same structure, shapes, dtypes and shardings (the plan's view of the real weights)."""
    pairs = zip(jax.tree.leaves(abstract_tree), jax.tree.leaves(real_tree), strict=True)
    return all((a.shape, a.dtype, a.sharding) == (r.shape, r.dtype, r.sharding) for a, r in pairs)


def test_full_policy_casts_for_the_forward_and_copies_for_the_reference(tiny_config):
    policy, params = built_policy(tiny_config(), jnp.bfloat16)
    assert isinstance(policy, FullPolicy) and policy.frozen == () and policy.base is None
    assert policy.train_graphdef is policy.policy_graphdef
    forward = policy.forward_params(params)
    expected = cast_floating(params, jnp.bfloat16)
    for got, want in zip(jax.tree.leaves(forward), jax.tree.leaves(expected), strict=True):
        assert got.dtype == jnp.bfloat16 and np.array_equal(np.asarray(got), np.asarray(want))
    assert same_layout(policy.abstract_forward_params(abstract(params)), forward)
    reference = policy.reference(params)
    for ref, got in zip(jax.tree.leaves(reference), jax.tree.leaves(forward), strict=True):
        assert ref is not got and np.array_equal(np.asarray(ref), np.asarray(got))
    assert policy.reference_bytes(abstract(params)) == per_device_bytes(forward)
    assert policy.masters_beside_rollout(abstract(params)) == per_device_bytes(params)  # float32 masters stay


def test_full_policy_in_its_storage_dtype_is_not_copied(tiny_config):
    policy, params = built_policy(tiny_config(), jnp.float32)
    assert policy.forward_params(params) is params
    assert policy.masters_beside_rollout(abstract(params)) == 0


def test_lora_policy_merges_as_the_lora_module_does_and_plans_the_same_shapes(tiny_config):
    cfg = tiny_config("model.lora.rank=4", "model.lora.alpha=8")
    policy, adapters = built_policy(cfg, jnp.float32)
    rng = np.random.default_rng(0)
    adapters = jax.tree.map(lambda x: jax.device_put(jnp.asarray(rng.normal(0, 0.1, x.shape), x.dtype), x.sharding),
                            adapters)
    assert policy.frozen == (policy.base,) and policy.train_graphdef is not policy.base_graphdef
    merged = policy.forward_params(adapters)
    expected = lora.merged_state(policy.base, adapters, policy.adapter_spec)
    for got, want in zip(jax.tree.leaves(merged), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)  # jit vs eager f32
    assert same_layout(policy.abstract_forward_params(abstract(adapters)), merged)
    assert policy.reference(adapters) is policy.base and policy.reference_bytes(abstract(adapters)) == 0
    policy.merged_rollout = False  # the per-token decode: the base with the adapters
    per_token = policy.forward_params(adapters)
    assert policy.policy_graphdef is policy.train_graphdef
    assert same_layout(policy.abstract_forward_params(abstract(adapters)), per_token)
    assert jax.tree.structure(per_token) == jax.tree.structure(nnx.merge_state(policy.base, adapters))
