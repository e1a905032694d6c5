"""grpo-jax device meshes: strategies on the ("dp", "fsdp", "tp") axes, logical
sharding rules, rollout/training batch shardings, multi-host start-up and
pre-flight validation.

Runner order: setup_processes(cfg.mesh) -> build_mesh_from_config(cfg.mesh, specs)
-> validate_plan(mesh, ModelDims.from_config(...), ...) -> shard params with
strategy.param_rules -> global_batch(rows, rollout_batch_sharding(mesh, style)).
"""

from grpo_meshes.batch import (
    ROLLOUT_BATCH_AXES,
    TRAIN_BATCH_AXES,
    batch_shard_count,
    batch_spec,
    global_batch,
    global_rows,
    local_batch_shard_count,
    rollout_activation_rules,
    rollout_batch_axes,
    rollout_batch_sharding,
    rollout_batch_spec,
    train_batch_sharding,
    train_batch_spec,
)
from grpo_meshes.distributed import (
    ProcessLayout,
    distributed_reason,
    initialize_distributed,
    setup_processes,
)
from grpo_meshes.errors import MeshError, MeshWarning
from grpo_meshes.resolve import ResolvedMesh, build_mesh_from_config, make_options, resolve_strategy
from grpo_meshes.rules import PARAM_RULES, TRAIN_ACTIVATION_RULES, Rules, with_batch_axes
from grpo_meshes.shapes import AXES, parse_shape, resolve_shape
from grpo_meshes.strategies import HostLocalStrategy, MeshStrategy, fsdp_groups_spanning_processes
from grpo_meshes.validate import ModelDims, validate_plan

__all__ = [
    "AXES",
    "HostLocalStrategy",
    "MeshError",
    "MeshStrategy",
    "MeshWarning",
    "ModelDims",
    "PARAM_RULES",
    "ProcessLayout",
    "ROLLOUT_BATCH_AXES",
    "ResolvedMesh",
    "Rules",
    "TRAIN_ACTIVATION_RULES",
    "TRAIN_BATCH_AXES",
    "batch_shard_count",
    "batch_spec",
    "build_mesh_from_config",
    "distributed_reason",
    "fsdp_groups_spanning_processes",
    "global_batch",
    "global_rows",
    "initialize_distributed",
    "local_batch_shard_count",
    "make_options",
    "parse_shape",
    "resolve_shape",
    "resolve_strategy",
    "rollout_activation_rules",
    "rollout_batch_axes",
    "rollout_batch_sharding",
    "rollout_batch_spec",
    "setup_processes",
    "train_batch_sharding",
    "train_batch_spec",
    "validate_plan",
    "with_batch_axes",
]
