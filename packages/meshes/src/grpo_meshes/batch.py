"""Where batches live on the mesh, and global batches assembled from hosts.

Rollout styles:
  legacy   batch over dp*fsdp*tp: every device samples its own rows.
  maxtext  batch over dp only, replicated over fsdp and tp: the fsdp/tp group
           of a replica decodes the same rows together with sharded weights.
Training batches are split over dp*fsdp (tp devices share rows).
"""

from __future__ import annotations

import math
from typing import Any, Literal

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from grpo_meshes.errors import MeshError
from grpo_meshes.rules import TRAIN_ACTIVATION_RULES, Rules, with_batch_axes

RolloutStyle = Literal["legacy", "maxtext"]
ROLLOUT_BATCH_AXES: dict[str, tuple[str, ...]] = {
    "legacy": ("dp", "fsdp", "tp"),
    "maxtext": ("dp",),
}
TRAIN_BATCH_AXES: tuple[str, ...] = ("dp", "fsdp")


def rollout_batch_axes(style: str) -> tuple[str, ...]:
    """Mesh axes that split the rollout batch for `rollout.sharding: <style>`."""
    if style not in ROLLOUT_BATCH_AXES:
        raise MeshError(f"unknown rollout sharding style {style!r}; use one of {sorted(ROLLOUT_BATCH_AXES)}")
    return ROLLOUT_BATCH_AXES[style]


def batch_spec(batch_axes: tuple[str, ...], ndim: int = 2) -> PartitionSpec:
    """Leading (row) dimension over `batch_axes`, the other `ndim - 1` replicated."""
    return PartitionSpec(batch_axes, *([None] * (ndim - 1)))


def rollout_batch_spec(style: str, ndim: int = 2) -> PartitionSpec:
    return batch_spec(rollout_batch_axes(style), ndim)


def train_batch_spec(ndim: int = 2) -> PartitionSpec:
    return batch_spec(TRAIN_BATCH_AXES, ndim)


def rollout_batch_sharding(mesh: Mesh, style: str, ndim: int = 2) -> NamedSharding:
    """Sharding of rollout arrays [B, ...] (prompts, tokens, masks, log-probs)."""
    return NamedSharding(mesh, rollout_batch_spec(style, ndim))


def train_batch_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
    """Sharding of training arrays [B, ...] (tokens, masks, advantages [B])."""
    return NamedSharding(mesh, train_batch_spec(ndim))


def rollout_activation_rules(style: str) -> Rules:
    """Activation rules during rollout: the batch takes the style's axes, and a
    logical name that would reuse one of them is replicated instead."""
    return with_batch_axes(TRAIN_ACTIVATION_RULES, rollout_batch_axes(style))


def batch_shard_count(mesh: Mesh, batch_axes: tuple[str, ...]) -> int:
    """How many row blocks the batch is cut into."""
    return math.prod(mesh.shape[axis] for axis in batch_axes)


def local_batch_shard_count(mesh: Mesh, batch_axes: tuple[str, ...], process_index: int | None = None) -> int:
    """How many distinct row blocks this process's devices hold."""
    process_index = jax.process_index() if process_index is None else process_index
    axis_positions = [mesh.axis_names.index(axis) for axis in batch_axes]
    blocks = {
        tuple(index[i] for i in axis_positions)
        for index, device in np.ndenumerate(mesh.devices)
        if device.process_index == process_index
    }
    return len(blocks)


def _spec_batch_axes(spec: PartitionSpec) -> tuple[str, ...]:
    first = spec[0] if len(spec) else None
    if first is None:
        return ()
    return (first,) if isinstance(first, str) else tuple(first)


def global_rows(local_rows: int, mesh: Mesh, batch_axes: tuple[str, ...]) -> int:
    """Rows of the global batch when every process contributes `local_rows`;
    raises MeshError when `local_rows` does not split over the local devices."""
    local_blocks = local_batch_shard_count(mesh, batch_axes)
    if local_rows % local_blocks:
        raise MeshError(_indivisible_message(local_rows, local_blocks, mesh, batch_axes))
    return local_rows // local_blocks * batch_shard_count(mesh, batch_axes)


def _indivisible_message(rows: int, blocks: int, mesh: Mesh, batch_axes: tuple[str, ...]) -> str:
    scale = batch_shard_count(mesh, batch_axes) // blocks
    lower, upper = rows // blocks * blocks, (rows // blocks + 1) * blocks
    valid = [n for n in (lower, upper) if n > 0]
    sizes = " or ".join(f"{n} (global {n * scale})" for n in valid)
    axes = "*".join(batch_axes)
    return (f"local batch of {rows} rows on process {jax.process_index()} is not divisible by the "
            f"{blocks} row blocks this process holds on the batch axes {axes} "
            f"(mesh {dict(mesh.shape)}); use a per-process batch that is a multiple of {blocks}, "
            f"the nearest being {sizes}")


def global_batch(local_data: Any, sharding: Any) -> Any:
    """Assemble global jax.Arrays from this process's rows.

    `local_data` is a pytree of numpy arrays [b, ...] holding this process's
    rows; `sharding` one NamedSharding or a pytree prefix of them. Every
    process calls this with the same structure. A process's rows land on its
    own devices (in process order on process-major meshes such as host_local
    or explicit shapes). When the batch axes are replicated across processes
    (e.g. maxtext on a mesh with dp=1) every process must pass the same rows,
    and the global batch is those rows.
    """
    if isinstance(sharding, NamedSharding):
        return jax.tree.map(lambda leaf: _global_array(np.asarray(leaf), sharding), local_data)
    return jax.tree.map(lambda one, subtree: global_batch(subtree, one), sharding, local_data,
                        is_leaf=lambda node: isinstance(node, NamedSharding))


def _global_array(local: np.ndarray, sharding: NamedSharding) -> jax.Array:
    rows = global_rows(local.shape[0], sharding.mesh, _spec_batch_axes(sharding.spec))
    return jax.make_array_from_process_local_data(sharding, local, (rows, *local.shape[1:]))
