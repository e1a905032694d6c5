"""`loss.routing_replay` in the update of a Qwen3-MoE policy: the rollout's recorded experts reach
the update batch, every forward of the update replays them (so the mismatch metrics are the
replayed forward's), router/replay_agreement says how often the trainer's router agrees, and a
dense model or a rollout that records nothing is refused in one line."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from grpo_core.config import LossConfig, MultiTurnConfig, PartialConfig, RolloutConfig
from grpo_core.contracts import Policy, SamplingParams
from grpo_core.errors import ConfigError
from grpo_core.models import QwenConfig, init_from_config
from grpo_losses import FusedLogps, FusedOptions
from grpo_rollout import JaxRollout, JaxRolloutOptions
from grpo_runner_gsm8k.cli import main
from grpo_core.models.router_stats import RouterStats
from grpo_runner_gsm8k.training.router_term import replayed_routing, router_metrics, routing_replay
from grpo_runner_gsm8k.training.step import UpdateBatch, make_update
from grpo_runner_gsm8k.training.train_metrics import objective_metrics

MOE = QwenConfig.tiny("qwen3_moe", vocab_size=64)
PROMPTS = [[5, 9, 2, 7], [11, 3], [8, 8, 1], [4]]
SAMPLING = SamplingParams(max_new_tokens=8, n=2, temperature=1.0, record_routing=True)
LOSS = LossConfig(max_completion_length=8, mismatch_correction="truncate", routing_replay=True)
FUSED = FusedLogps(FusedOptions(block_size=64, time_block=4))


def rollout_batch(model):
    """A recorded rollout of `model` as the update's batch (the loop's `update_batch`, on one device)."""
    rollout = JaxRollout(JaxRolloutOptions(prompt_buckets=(4,), trim_bucket=4))
    rollout.load_weights(Policy.of(model))
    result = rollout.generate(PROMPTS, jax.random.key(3), SAMPLING, pad_token_id=0)
    trimmed = rollout.trim(result)
    width = trimmed.prompt_width
    advantages = jnp.asarray(np.random.default_rng(0).normal(size=len(PROMPTS) * SAMPLING.n), jnp.float32)
    return result, UpdateBatch(
        trimmed.input_ids, trimmed.attention_mask, trimmed.input_ids[:, width:],
        trimmed.completion_mask[:, width:].astype(jnp.float32), advantages,
        sampler_logp=trimmed.sampler_logps[:, width:], prompt_width=width,
        routing=replayed_routing(LOSS.routing_replay, trimmed.experts, jnp.asarray))


def update_metrics(graphdef, params, batch) -> dict:
    update = make_update(graphdef, FUSED, LOSS, optax.sgd(0.0), SAMPLING.temperature, 1, router_coef=0.0)
    donated = jax.tree.map(jnp.copy, params)
    return jax.device_get(update(donated, optax.sgd(0.0).init(donated), batch)[2])


def test_recorded_routing_reaches_the_update_and_its_agreement_is_logged():
    model = init_from_config(MOE, seed=0)
    graphdef, params = nnx.split(model)
    result, batch = rollout_batch(model)
    assert batch.routing.shape == (*batch.input_ids.shape, MOE.num_hidden_layers, MOE.num_experts_per_tok)
    assert int((batch.routing >= 0).sum()) > 0
    replayed = update_metrics(graphdef, params, batch)
    logged = objective_metrics(replayed, result, LOSS)
    assert logged["router/replay_agreement"] == 1.0  # same params, f32: the trainer routes as the rollout did
    assert logged["train-other/mismatch_kl"] < 1e-6  # sampler and trainer agree to f32 rounding
    # Forced experts (no router chooses them all): the replayed forward moves away from the
    # sampler's log-probs, and the mismatch metrics show it.
    forced = jnp.where(batch.routing >= 0, (batch.routing + 1) % MOE.num_experts, -1).astype(batch.routing.dtype)
    moved = update_metrics(graphdef, params, batch.replace(routing=forced))
    assert moved["router/replay_agreement"] < 0.75
    assert moved["mismatch_kl"] > 100 * max(replayed["mismatch_kl"], 1e-8)
    assert moved["mismatch_ratio_max"] > replayed["mismatch_ratio_max"]


def test_no_agreement_metric_without_a_record():
    stats = RouterStats(jnp.full((2, 4), 0.25), jnp.asarray(2.0))
    assert "router/replay_agreement" not in router_metrics(stats)
    assert router_metrics(stats.__class__(stats.load, stats.balance_loss, jnp.asarray(0.5)))["router/replay_agreement"] == 0.5


def test_a_replay_without_a_record_is_refused():
    assert replayed_routing(False, None, jnp.asarray) is None
    with pytest.raises(RuntimeError, match="loss.routing_replay = true but the rollout returned no routing record"):
        replayed_routing(True, None, jnp.asarray)


@pytest.mark.parametrize("rollout, named", [
    (RolloutConfig(partial=PartialConfig(enabled=True)), "rollout.partial.enabled"),
    (RolloutConfig(multi_turn=MultiTurnConfig(enabled=True)), "rollout.multi_turn.enabled"),
    (RolloutConfig(options={"decode_attention": "model"}), "rollout.options.decode_attention=model"),
    (RolloutConfig(options={"gather_weights": "head_parallel"}), "rollout.options.gather_weights=head_parallel"),
])
def test_replay_refused_where_the_rollout_records_nothing(rollout, named):
    assert routing_replay(LOSS, RolloutConfig(), MOE) is True
    assert routing_replay(LossConfig(), rollout, MOE) is False
    with pytest.raises(ConfigError, match=f"loss.routing_replay = true with {named}: that rollout records no"):
        routing_replay(LOSS, rollout, MOE)


def test_replay_refused_for_a_dense_model():
    with pytest.raises(ConfigError, match=r"loss.routing_replay = true .* model_type qwen3 has no router"):
        routing_replay(LOSS, RolloutConfig(), QwenConfig.tiny("qwen3"))


def test_grpo_run_refuses_routing_replay_for_a_dense_model_at_config_load(tiny_config_path, capsys):
    assert main(["--config", tiny_config_path, "--print-config", "loss.routing_replay=true"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model_type qwen2 has no router" in err[0], err
