"""The step's advantages: the rows dynamic sampling keeps (`grpo_core.advantage_records.kept_rows`,
the zero-std rule), then the configured estimator (`loss.advantage_estimator`) over the step's
scores. The scores are host values of the whole global step batch on every process (the
rollout is gathered before scoring), so every process computes the same advantages and each
statistic over the step is the global step's.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from grpo_core.advantage_records import StepRewards, kept_rows, zero_std_groups
from grpo_core.contracts import AdvantageEstimator

from grpo_runner_gsm8k.training.scoring import Scores


class StepAdvantages(NamedTuple):
    """advantages [N] float32; keep [N] float32, 1 on rows dynamic sampling keeps; metrics
    train-other/* of the estimator, and the fraction of zero-std groups."""

    advantages: np.ndarray
    keep: np.ndarray
    metrics: dict


def step_advantages(estimator: AdvantageEstimator, scores: Scores, group_size: int,
                    dynamic_sampling: bool) -> StepAdvantages:
    """The advantages of one step's rows (see module doc)."""
    keep = kept_rows(scores.total, group_size, dynamic_sampling)
    computed = estimator(StepRewards(scores.total, scores.per_fn, keep, scores.episodes))
    advantages = np.asarray(computed.advantages, np.float32).reshape(-1)
    if advantages.shape != keep.shape:
        raise ValueError(f"the advantage estimator returned {advantages.size} advantages for {keep.size} rows; "
                         "it must return one per row")
    zero_std = zero_std_groups(scores.total, group_size)
    return StepAdvantages(advantages, keep, {**computed.metrics, "train-other/zero_std_frac": float(zero_std.mean())})
