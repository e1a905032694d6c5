"""Pre-flight checks of a mesh plan, run before anything is compiled.

Divisibility rules (no padding is done anywhere):
  dp*fsdp*tp                          == number of devices
  num_attention_heads, num_key_value_heads, vocab_size, intermediate_size
                                      multiples of tp (they are split over tp)
  hidden_size                         multiple of fsdp (weights are split on it)
  rollout batch (prompts * samples)   multiple of dp*fsdp*tp (legacy) or dp (maxtext)
  training micro-batch                multiple of dp*fsdp
A vocabulary that tp does not divide must be padded to a multiple of tp in the
checkpoint (extra rows never sampled); Qwen's 151936 = 2^7 * 1187 and
152064 = 2^9 * 297 need no padding for tp <= 128.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional, Union

from jax.sharding import Mesh

from grpo_meshes.batch import TRAIN_BATCH_AXES, rollout_batch_axes
from grpo_meshes.errors import MeshError
from grpo_meshes.shapes import AXES, check_shape_matches_devices, divisors, format_shape

TP_SPLIT_DIMS = ("num_attention_heads", "num_key_value_heads", "vocab_size", "intermediate_size")


@dataclass(frozen=True)
class ModelDims:
    """The model sizes that the mesh splits."""

    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    hidden_size: int
    intermediate_size: int

    @classmethod
    def from_config(cls, config: Any) -> "ModelDims":
        """From a QwenConfig, an HF config object or a config.json mapping."""
        get = config.get if isinstance(config, Mapping) else lambda name: getattr(config, name, None)
        values = {name: get(name) for name in cls.__dataclass_fields__}
        missing = [name for name, value in values.items() if value is None]
        if missing:
            raise MeshError(f"model config lacks {missing}, needed to check the mesh; "
                            f"pass a Qwen/HF config that has them")
        return cls(**{name: int(value) for name, value in values.items()})


def validate_plan(mesh_shape: Union[Mesh, tuple[int, int, int]], model_dims: Optional[ModelDims] = None,
                  rollout_batch: Optional[int] = None, train_micro_batch: Optional[int] = None,
                  rollout_style: str = "legacy", device_count: Optional[int] = None) -> None:
    """Raise one MeshError listing every problem of the plan (None skips a check).

    mesh_shape: a Mesh or (dp, fsdp, tp); rollout_batch: global rows of a
    rollout (prompts * samples); train_micro_batch: global rows of one
    training micro-batch; device_count: devices the mesh must cover.
    """
    shape = _shape_of(mesh_shape)
    problems = []
    if device_count is not None:
        problems += _capture(check_shape_matches_devices, shape, device_count)
    if model_dims is not None:
        problems += model_dim_problems(shape, model_dims)
    if rollout_batch is not None:
        problems += batch_problems("rollout batch", rollout_batch, shape, rollout_batch_axes(rollout_style),
                                   f"rollout.sharding={rollout_style}")
    if train_micro_batch is not None:
        problems += batch_problems("training micro-batch", train_micro_batch, shape, TRAIN_BATCH_AXES,
                                   "training")
    if problems:
        raise MeshError(f"mesh {format_shape(shape)} (dp,fsdp,tp) cannot run this plan:\n  - "
                        + "\n  - ".join(problems))


def _shape_of(mesh_shape: Union[Mesh, tuple[int, ...]]) -> tuple[int, int, int]:
    if isinstance(mesh_shape, Mesh):
        return tuple(mesh_shape.shape[axis] for axis in AXES)  # type: ignore[return-value]
    shape = tuple(int(s) for s in mesh_shape)
    if len(shape) != 3 or min(shape) < 1:
        raise MeshError(f"mesh shape {mesh_shape!r} must be three sizes >= 1 (dp, fsdp, tp); "
                        f"resolve -1 entries with the strategy first")
    return shape  # type: ignore[return-value]


def _capture(check, *args) -> list[str]:
    try:
        check(*args)
    except MeshError as exc:
        return [str(exc)]
    return []


def model_dim_problems(shape: tuple[int, int, int], dims: ModelDims) -> list[str]:
    _, fsdp, tp = shape
    problems = [
        f"tp={tp} does not divide {name}={getattr(dims, name)} (split over tp); "
        f"use tp in {_valid_tp(dims, math.prod(shape))}" + (
            ", or pad the vocabulary to a multiple of tp" if name == "vocab_size" else "")
        for name in TP_SPLIT_DIMS if getattr(dims, name) % tp
    ]
    if dims.hidden_size % fsdp:
        valid = [d for d in divisors(dims.hidden_size) if math.prod(shape) % d == 0]
        problems.append(f"fsdp={fsdp} does not divide hidden_size={dims.hidden_size} (weights are split "
                        f"over fsdp on it); use fsdp in {valid[-4:]} and put the other devices on dp")
    return problems


def _valid_tp(dims: ModelDims, device_count: int) -> list[int]:
    common = math.gcd(*(getattr(dims, name) for name in TP_SPLIT_DIMS))
    return [d for d in divisors(common) if device_count % d == 0]


def batch_problems(what: str, rows: int, shape: tuple[int, int, int], batch_axes: tuple[str, ...],
                   context: str) -> list[str]:
    ways = math.prod(shape[AXES.index(axis)] for axis in batch_axes)
    if rows % ways == 0:
        return []
    lower, upper = rows // ways * ways, (rows // ways + 1) * ways
    nearest = " or ".join(str(n) for n in (lower, upper) if n > 0)
    return [f"{what} of {rows} rows is not divisible by {'*'.join(batch_axes)} = {ways} ({context}); "
            f"use a multiple of {ways}, the nearest being {nearest}"]
