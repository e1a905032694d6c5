"""A LoRA run's policy for rollout and scoring: the merged copy and the per-token adapters
give the same hidden states, on 8 FSDP-sharded devices; the merged copy is taken when it
fits in the devices' spare memory, the per-token path otherwise; the base is the reference."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from grpo_core.models import QwenConfig, init_from_config
from grpo_core.sharding import shard_model
from grpo_meshes import MeshStrategy
from grpo_runner_gsm8k.assembly import adapters as lora_run

QCFG = QwenConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, tie_word_embeddings=True)
FSDP8 = MeshStrategy("fsdp8", (1, 8, 1))
IDS = (jnp.arange(32).reshape(4, 8) * 5) % 64


def lora_setup(tiny_config):
    cfg = tiny_config("model.lora.rank=4", "model.lora.rslora=true")
    mesh = FSDP8.build_mesh()
    model = shard_model(init_from_config(QCFG, seed=0), mesh, FSDP8.param_rules)
    run, adapters = lora_run.setup_lora(cfg.model, model, mesh, FSDP8.param_rules, jnp.float32)
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
    run.decide_rollout(None, None)
    assert run.merged_rollout  # CPU devices report no memory limit
    merged = hidden(run.policy_graphdef, run.forward_params(adapters))
    base = hidden(run.base_graphdef, run.reference(adapters))
    run.merged_rollout = False
    graphdef, state = run.policy_graphdef, run.forward_params(adapters)
    assert graphdef is run.train_graphdef
    np.testing.assert_allclose(hidden(graphdef, state), merged, rtol=1e-5, atol=1e-5)
    assert np.abs(merged - base).max() > 0.1  # the base is the adapters-off model
    # the per-token reference (zero adapters on the adapters' model) is the base exactly
    assert np.array_equal(hidden(graphdef, run.reference(adapters)), base)


@pytest.mark.parametrize("decode_needs, spare_over_copy, merged", [
    (0, 0, True),  # the copy exactly fits
    (0, -1, False),  # the copy alone does not
    (1 << 20, (1 << 20) - 1, False),  # the copy fits, not with what its decode needs beside it
    (None, 1 << 40, False),  # the compiler refused the merged decode
])
def test_merged_copy_only_when_it_and_its_decode_fit(decode_needs, spare_over_copy, merged, tiny_config, capsys):
    run, _, _ = lora_setup(tiny_config)
    run.decide_rollout(decode_needs, run.merged_copy_bytes() + spare_over_copy)
    assert run.merged_rollout == merged
    assert (run.policy_graphdef is run.base_graphdef) == merged
    said = "merges the adapters once per rollout" if merged else "applies the adapters per token"
    assert said in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.parametrize("spare, merged", [(1 << 40, True), (1 << 10, False)])
def test_the_run_decides_its_rollout_by_the_compiled_merged_decode_and_trains_either_way(
        tiny_config, tmp_path, monkeypatch, spare, merged):
    """The run compiles the merged copy's decode for its batch and weighs it (with the copy)
    against the devices' spare memory; the per-token run also scores its reference (beta > 0)."""
    from grpo_core.registry import default_registry
    from grpo_runner_gsm8k.assembly import adapters
    from grpo_runner_gsm8k.loop import Trainer, build_run

    measured = []
    needs = adapters.merged_decode_needs
    monkeypatch.setattr(adapters, "merged_decode_needs", lambda *args: measured.append(needs(*args)) or measured[0])
    monkeypatch.setattr(adapters, "spare_device_bytes", lambda devices: spare)
    cfg = tiny_config("train.steps=1", "rollout.prompts_per_step=4", "rollout.n=4", "eval.every_steps=0",
                      "model.lora.rank=4", "loss.beta=0.05")
    trainer = Trainer(build_run(cfg, default_registry()))
    assert measured[0] > 0  # the KV cache and loop state at least
    assert trainer.built.policy.merged_rollout == merged
    trainer.run()
    record = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert np.isfinite(record["train-other/loss"]) and np.isfinite(record["train-other/kl"])
