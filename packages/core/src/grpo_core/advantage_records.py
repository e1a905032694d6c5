"""What an advantage estimator (`grpo_core.contracts.AdvantageEstimator`) is built from,
receives and returns, and the one rule of which groups carry no learning signal.

A step's rewards are a flat [P * K] vector, prompt-major: rows p*K .. p*K+K-1 are the K
completions of prompt p (rollout.n = K, the group). A group whose K rewards all agree has
zero reward std and nothing to learn from for any group-relative estimator; dynamic
sampling (DAPO, Yu et al. 2025, sec. 3.2) masks or replaces such groups. The rule is
`zero_std_groups`, called by the advantage estimators, by refill and by the code that
picks the rows the loss trains on (`kept_rows`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, NamedTuple

import numpy as np


@dataclass(frozen=True)
class AdvantageSetup:
    """What a run tells its advantage estimator when building it (`from_config`); a factory
    raises ValueError, with the fix, for a setup it cannot serve (the config is then refused).

    group_size:     rollout.n (K): rows p*K .. p*K+K-1 of a step share prompt p.
    reward_weights: task.rewards, reward function name -> weight, in config order.
    scale_rewards, std_ddof, eps: loss.scale_rewards, loss.std_ddof, loss.advantage_eps.
    """

    group_size: int
    reward_weights: Mapping[str, float]
    scale_rewards: str = "group"
    std_ddof: int = 1
    eps: float = 1e-4

    @classmethod
    def from_config(cls, cfg: Any) -> "AdvantageSetup":
        """From a `grpo_core.config.RunConfig`."""
        loss = cfg.loss
        return cls(cfg.rollout.n, {name: float(w) for name, w in cfg.task.rewards.items()}, loss.scale_rewards,
                   loss.std_ddof, loss.advantage_eps)


@dataclass(frozen=True)
class StepRewards:
    """One step's rewards: host arrays over the whole global step batch (every process holds
    the same, as the rollout and its scores are gathered), N = P * K rows, prompt-major.

    total:  [N] float32, sum over reward functions of weight * reward.
    per_fn: reward function name -> [N] float32 unweighted rewards (keys as task.rewards).
    keep:   [N] float32, 1 on rows the step trains on, 0 on rows dynamic sampling masks
            (`kept_rows`); statistics over the step use the kept rows only.
    episodes: what a multi-turn rollout knows of each row's turns (empty otherwise): turns,
            tool_calls, tool_errors, tool_timeouts [N] int32; token_turn [N, T] int32, the
            assistant turn (0, 1, ...) of each completion token, -1 on tool-turn tokens and
            padding (T the rollout's completion width).
    """

    total: Any
    per_fn: Mapping[str, Any]
    keep: Any
    episodes: Mapping[str, Any] = field(default_factory=dict)


class AdvantageResult(NamedTuple):
    """advantages: [N] float32, one per row. metrics: `train-other/...` name -> float, what the
    estimator computed (e.g. `train-other/adv_baseline_mean`, `train-other/adv_std`)."""

    advantages: Any
    metrics: dict[str, float]


def grouped(values: Any, group_size: int) -> np.ndarray:
    """[P, K] float32 view of the flat [P * K] `values`."""
    values = np.asarray(values, np.float32).reshape(-1)
    if group_size < 1 or values.size % group_size:
        raise ValueError(f"{values.size} rewards do not split into groups of {group_size}; "
                         "pass rewards as [prompts * samples_per_prompt] with group_size = samples_per_prompt")
    return values.reshape(-1, group_size)


def zero_std_groups(rewards: Any, group_size: int) -> np.ndarray:
    """[P] bool: the group's rewards are all equal (no signal to learn from)."""
    groups = grouped(rewards, group_size)
    return np.all(groups == groups[:, :1], axis=1)


def kept_rows(rewards: Any, group_size: int, dynamic_sampling: bool) -> np.ndarray:
    """[P * K] float32, 1 on the rows the step trains on: with dynamic sampling, the rows of
    groups whose rewards do not all agree; without it, every row."""
    if not dynamic_sampling:
        return np.ones(grouped(rewards, group_size).size, np.float32)
    return np.repeat(~zero_std_groups(rewards, group_size), group_size).astype(np.float32)
