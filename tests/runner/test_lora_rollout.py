"""A LoRA run's policy for rollout and scoring: the merged copy and the per-token adapters
give the same hidden states, on 8 FSDP-sharded devices; the merged copy is taken when it
fits in the devices' spare memory, the per-token path otherwise; the base is the reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from grpo_core.models import QwenConfig, init_from_config
from grpo_core.sharding import shard_model
from grpo_meshes import MeshStrategy
from grpo_runner_gsm8k import adapters as lora_run

QCFG = QwenConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, tie_word_embeddings=True)
FSDP8 = MeshStrategy("fsdp8", (1, 8, 1))
IDS = (jnp.arange(32).reshape(4, 8) * 5) % 64


def lora_setup(tiny_config):
    cfg = tiny_config("model.lora.rank=4", "model.lora.rslora=true")
    mesh = FSDP8.build_mesh()
    model = shard_model(init_from_config(QCFG, seed=0), mesh, FSDP8.param_rules)
    run, adapters = lora_run.setup_lora(cfg, model, mesh, FSDP8.param_rules)
    rng = np.random.default_rng(0)
    adapters = jax.tree.map(lambda x: jax.device_put(jnp.asarray(rng.normal(0, 0.1, x.shape), x.dtype), x.sharding),
                            adapters)
    return run, adapters, mesh


def hidden(graphdef, state):
    return np.asarray(nnx.merge(graphdef, state)(IDS))


def test_merged_and_per_token_policies_agree_and_are_sharded_like_the_base(tiny_config):
    run, adapters, mesh = lora_setup(tiny_config)
    a = adapters["layers"]["mlp"]["up_proj"]["lora"]["a"].get_value()
    assert a.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", None)  # embed -> fsdp, as the kernel
    run.decide_merge(mesh)
    assert run.merged_rollout  # CPU devices report no memory limit
    merged = hidden(*run.policy(adapters, jnp.float32))
    run.merged_rollout = False
    graphdef, state = run.policy(adapters, jnp.float32)
    assert graphdef is run.train_graphdef
    np.testing.assert_allclose(hidden(graphdef, state), merged, rtol=1e-5, atol=1e-5)
    assert np.abs(merged - hidden(run.base_graphdef, run.base)).max() > 0.1  # the base is the adapters-off model


def test_per_token_adapters_when_the_merged_copy_does_not_fit(tiny_config, monkeypatch, capsys):
    run, _, mesh = lora_setup(tiny_config)
    monkeypatch.setattr(lora_run, "spare_device_bytes", lambda devices: 10)
    run.decide_merge(mesh)
    assert not run.merged_rollout and run.policy_graphdef is run.train_graphdef
    assert "applies the adapters per token" in capsys.readouterr().out
