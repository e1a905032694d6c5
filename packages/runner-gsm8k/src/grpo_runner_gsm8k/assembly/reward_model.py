"""The reward model of the `reward_model` reward on the run's mesh: loaded, placed and scoring.

Like the distillation teacher (assembly.teacher), it is a frozen model of its own (its family and
dtype, task.reward_options.reward_model.dtype), its decoder sharded over the mesh by the policy's
parameter rules and attending as the policy does (model.attention); its score head [H] is
replicated. Batches of conversations are split over the mesh's data axes like training rows. The
plan builds the same object on shapes (`abstract_reward_model`) and counts its weights as resident
for the whole run and its forward as a phase of its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from grpo_core.config import ModelConfig, TaskConfig
from grpo_core.config_io import plugin_options
from grpo_core.models import QwenConfig, load_pretrained
from grpo_core.models.hf_io import abstract_model
from grpo_core.models.qwen import resolve_dtype
from grpo_core.models.sequence_scores import SCORE_HEAD, sequence_scores
from grpo_core.sharding import param_shardings
from grpo_meshes import TRAIN_BATCH_AXES, batch_shard_count, train_batch_sharding

from grpo_runner_gsm8k.assembly.teacher import prepare_frozen_model
from grpo_runner_gsm8k.multihost import host_array
from grpo_runner_gsm8k.tasks.reward_model import (REWARD_MODEL, RewardModelOptions, RewardModelReward,
                                                  read_reward_model, reward_model_error, scored_length)

REWARD_MODEL_PHASE = "reward model"  # its forward's name in the plan


@dataclass(frozen=True)
class RewardModel:
    """qcfg: its decoder's architecture; params (real or, in the plan, abstract) in its dtype,
    sharded by the policy's rules; head [H] replicated; score: the jitted
    `score(params, head, input_ids, attention_mask, index) -> [B] float32`; rows: conversations per
    forward (batch_size rounded up to the data shards); width: the widest padded conversation."""

    qcfg: QwenConfig
    params: Any
    head: Any
    score: Callable[..., jax.Array]
    rows: int
    width: int
    mesh: Mesh

    def scorer(self, input_ids: np.ndarray, attention_mask: np.ndarray, index: np.ndarray) -> np.ndarray:
        """Scores of one host batch [rows, T] (every process passes the same batch)."""
        args = [on_mesh(x, self.mesh) for x in (input_ids, attention_mask, index)]
        return host_array(self.score(self.params, self.head, *args))


def on_mesh(host: np.ndarray, mesh: Mesh) -> jax.Array:
    """A host batch [B, ...] split over the mesh's data axes, as training rows are."""
    sharding = train_batch_sharding(mesh, ndim=host.ndim)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def make_reward_score(graphdef: nnx.GraphDef) -> Callable[..., jax.Array]:
    @jax.jit
    def score(params, head, input_ids, attention_mask, index):
        return sequence_scores(nnx.merge(graphdef, params), head, input_ids, attention_mask, index)

    return score


def reward_model_options(task: TaskConfig) -> Optional[RewardModelOptions]:
    """The options of the run's `reward_model` reward, None when task.rewards has none."""
    if REWARD_MODEL not in task.rewards:
        return None
    return plugin_options(RewardModelOptions, task.reward_options.get(REWARD_MODEL, {}),
                          f"task.reward_options.{REWARD_MODEL}")


def data_rows(batch_size: int, mesh: Mesh) -> int:
    """batch_size rounded up to a multiple of the mesh's data shards."""
    shards = batch_shard_count(mesh, TRAIN_BATCH_AXES)
    return -(-batch_size // shards) * shards


def prepared(model: Any, options: RewardModelOptions, model_cfg: ModelConfig, mesh: Mesh, strategy: Any) -> Any:
    """`model` with the policy's activation sharding and model.attention for the reward model's dtype."""
    return prepare_frozen_model(model, model_cfg.attention, options.dtype, mesh, strategy, "reward model",
                                f"task.reward_options.{REWARD_MODEL}.dtype")


def load_reward_model(options: RewardModelOptions, model_cfg: ModelConfig, mesh: Mesh, strategy: Any) -> RewardModel:
    """The reward model's weights straight onto the mesh in its dtype (frozen: forward only)."""
    model_dir, head = read_reward_model(options)
    try:
        model = load_pretrained(model_dir, dtype=options.dtype, mesh=mesh, rules=list(strategy.param_rules),
                                scan_layers=model_cfg.scan_layers, config=head.decoder, skip={SCORE_HEAD})
    except (OSError, ValueError) as exc:
        raise reward_model_error(options, exc, "re-download or re-save the reward model") from None
    graphdef, params = nnx.split(prepared(model, options, model_cfg, mesh, strategy))
    weight = jax.device_put(head.weight(resolve_dtype(options.dtype)), NamedSharding(mesh, PartitionSpec()))
    return RewardModel(head.decoder, params, weight, make_reward_score(graphdef), data_rows(options.batch_size, mesh),
                       scored_length(options, head), mesh)


def abstract_reward_model(options: RewardModelOptions, model_cfg: ModelConfig, mesh: Mesh,
                          strategy: Any) -> RewardModel:
    """The plan's reward model: its params and head as sharded shapes, placed as load_reward_model places them."""
    _, head = read_reward_model(options)
    dtype = resolve_dtype(options.dtype)
    model = prepared(abstract_model(head.decoder, dtype, "none", model_cfg.scan_layers), options, model_cfg, mesh,
                     strategy)
    graphdef, state = nnx.split(model)
    shardings = param_shardings(state, mesh, list(strategy.param_rules))
    params = jax.tree.map(lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding),
                          state, shardings)
    weight = jax.ShapeDtypeStruct((head.decoder.hidden_size,), dtype, sharding=NamedSharding(mesh, PartitionSpec()))
    return RewardModel(head.decoder, params, weight, make_reward_score(graphdef), data_rows(options.batch_size, mesh),
                       scored_length(options, head), mesh)


def place_reward_model(model_cfg: ModelConfig, rewards: dict, mesh: Mesh, strategy: Any) -> Optional[RewardModel]:
    """Loads the run's reward model (None without one) and gives the `reward_model` reward its scorer."""
    reward = rewards.get(REWARD_MODEL, (None,))[0]
    if not isinstance(reward, RewardModelReward):
        return None
    reward_model = load_reward_model(reward.options, model_cfg, mesh, strategy)
    reward.place(reward_model.scorer, reward_model.rows)
    return reward_model
