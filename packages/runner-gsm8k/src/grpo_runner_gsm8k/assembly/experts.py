"""`mesh.expert_parallel` decided for the run's model and batch (grpo_meshes.expert has the rule):
the strategy the model is then sharded and run with, and the one line the run prints about it."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from jax.sharding import Mesh

from grpo_core.config import RolloutConfig, TrainConfig
from grpo_core.errors import UserError
from grpo_core.models import QwenConfig
from grpo_meshes import TRAIN_BATCH_AXES, batch_shard_count
from grpo_meshes.errors import MeshError
from grpo_meshes.expert import EXPERT_AXIS, choose_expert_parallel, expert_traffic, with_expert_parallel
from grpo_runner_gsm8k.assembly.build import micro_batches, rows_per_step


def train_tokens_per_device(rollout: RolloutConfig, train: TrainConfig, mesh: Mesh) -> int:
    """Tokens one device runs through a layer per micro-batch of the update (rows x padded length)."""
    rows = rows_per_step(rollout) // micro_batches(rollout, train, mesh)
    return max(rows // batch_shard_count(mesh, TRAIN_BATCH_AXES), 1) * (rollout.max_prompt_length +
                                                                          rollout.max_new_tokens)


def expert_parallel_strategy(setting: bool | str, strategy: Any, mesh: Mesh, qcfg: QwenConfig, tokens: int,
                             dtype: Any) -> Any:
    """`strategy`, with the experts split over fsdp when `mesh.expert_parallel` (`setting`) takes
    expert parallelism for this model, `tokens` per device and compute `dtype`; prints the choice
    for a mixture-of-experts model (or a refused `true`: one-line error)."""
    experts = qcfg.num_experts if qcfg.family.sparse_mlp else None
    fsdp = mesh.shape[EXPERT_AXIS]
    size = jnp.dtype(dtype).itemsize
    traffic = None if experts is None else expert_traffic(
        experts, qcfg.hidden_size, qcfg.moe_intermediate_size, qcfg.num_experts_per_tok, tokens, fsdp, size, size)
    try:
        chosen, line = choose_expert_parallel(setting, experts, fsdp, traffic)
    except MeshError as exc:
        raise UserError(str(exc)) from None
    if experts is not None or setting != "auto":
        print(line)
    return with_expert_parallel(strategy) if chosen else strategy
