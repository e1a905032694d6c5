"""Group-relative advantages (the `grpo` estimator's arithmetic, see estimators.py).

Rewards are a flat [P * G] vector, prompt-major: the G completions of each prompt
are consecutive. A = (r - mean of its group) / (std + eps), where std is the
group's (`scale_rewards: group`), the whole batch's (`batch`), or 1 with no eps
(`none`, Dr.GRPO). Groups whose rewards all agree carry no learning signal
(`grpo_core.advantage_records.zero_std_groups`); with `dynamic_sampling` they are
masked out (shapes stay static).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from grpo_core.advantage_records import kept_rows, zero_std_groups
from grpo_core.config import LossConfig

Array = jax.Array


class Advantages(NamedTuple):
    """advantages [P*G] float32; keep [P*G] float32 (0 for samples of dropped
    groups, to multiply into the completion mask); zero_std [P] bool."""

    advantages: Array
    keep: Array
    zero_std: Array


def group_advantages(rewards: Array, group_size: int, *, scale_rewards: str = "group", std_ddof: int = 1,
                     eps: float = 1e-4) -> Array:
    """(r - group mean) / (std + eps) [P*G] for rewards [P*G] (see module doc)."""
    groups = _grouped(rewards, group_size)  # [P, G]
    centred = groups - jnp.mean(groups, axis=1, keepdims=True)
    if scale_rewards == "none":
        return centred.reshape(-1)
    if scale_rewards == "group":
        _check_ddof(group_size, std_ddof, "group size")
        std = jnp.std(groups, axis=1, ddof=std_ddof, keepdims=True)
    elif scale_rewards == "batch":
        _check_ddof(groups.size, std_ddof, "batch size")
        std = jnp.std(groups, ddof=std_ddof)
    else:
        raise ValueError(f"scale_rewards must be group, batch or none, got {scale_rewards!r}")
    return (centred / (std + eps)).reshape(-1)


def compute_advantages(rewards: Array, group_size: int, cfg: LossConfig) -> Advantages:
    """Advantages with the `loss` config's scaling, ddof and eps, plus the
    dynamic-sampling keep mask (all ones unless `cfg.dynamic_sampling`)."""
    advantages = group_advantages(rewards, group_size, scale_rewards=cfg.scale_rewards,
                                  std_ddof=cfg.std_ddof, eps=cfg.advantage_eps)
    keep = kept_rows(rewards, group_size, cfg.dynamic_sampling)
    return Advantages(advantages, jnp.asarray(keep), jnp.asarray(zero_std_groups(rewards, group_size)))


def _grouped(rewards: Array, group_size: int) -> Array:
    rewards = jnp.asarray(rewards, jnp.float32).reshape(-1)
    if group_size < 1 or rewards.size % group_size:
        raise ValueError(f"{rewards.size} rewards do not split into groups of {group_size}; "
                         "pass rewards as [prompts * samples_per_prompt] with group_size = samples_per_prompt")
    return rewards.reshape(-1, group_size)


def _check_ddof(count: int, ddof: int, what: str) -> None:
    if count <= ddof:
        raise ValueError(f"std with ddof={ddof} needs more than {ddof} rewards, but the {what} is {count}; "
                         "use more samples per prompt or set loss.std_ddof: 0")
