"""`score`: runs the reward functions of a step safely (a function that raises or returns
the wrong count scores its rows 0 and is counted, instead of stopping the run) and weights them.

A reward function that cannot score a completion returns None for it: that completion scores
0 from the function and counts in its errors, and the function is not called again for it
(docs/rewards.md, "A reward that cannot score": why 0 and not left out of the group).
"""

from __future__ import annotations

import logging
import math
from typing import Any, Mapping, Sequence

import numpy as np
from grpo_core.contracts import RewardFn
from grpo_core.rollout_records import Scores

from grpo_runner_gsm8k.tasks.rewards import check_pairs

logger = logging.getLogger(__name__)


def _as_rewards(values: Any, expected: int) -> np.ndarray:
    rewards = np.asarray(values, dtype=np.float64).reshape(-1)
    if rewards.shape[0] != expected:
        raise ValueError(f"reward function returned {rewards.shape[0]} values for {expected} completions")
    return rewards


def _unscored(values: Any) -> tuple[Any, int]:
    """`values` with each None (a completion the function cannot score) as 0.0, and how many there were."""
    if isinstance(values, np.ndarray) and values.dtype != object:
        return values, 0
    values = list(values)
    return [0.0 if value is None else value for value in values], sum(value is None for value in values)


def _one_by_one(fn: RewardFn, name: str, completions: Sequence[str],
                answers: Sequence[str]) -> tuple[np.ndarray, int]:
    """Per-sample calls after a failed batch call: a failing or non-finite sample scores 0."""
    rewards, errors = np.zeros(len(completions)), 0
    for i, (completion, answer) in enumerate(zip(completions, answers)):
        try:
            values, unscored = _unscored(fn([completion], [answer]))
            value = math.nan if unscored else _as_rewards(values, 1)[0]
        except Exception as exc:  # any plugin bug must not stop training
            logger.debug("reward %s failed on sample %d: %r", name, i, exc)
            value = math.nan
        if math.isfinite(value):
            rewards[i] = value
        else:
            errors += 1
    return rewards, errors


def _run_reward(fn: RewardFn, name: str, completions: Sequence[str],
                answers: Sequence[str]) -> tuple[np.ndarray, int]:
    try:
        values, unscored = _unscored(fn(list(completions), list(answers)))
        rewards = _as_rewards(values, len(completions))
        if np.isfinite(rewards).all():
            return rewards, unscored
    except Exception as exc:  # isolate below, sample by sample
        logger.warning("reward %s failed on a batch of %d (%r); scoring samples one by one",
                       name, len(completions), exc)
    return _one_by_one(fn, name, completions, answers)


def score(reward_fns: Mapping[str, tuple[RewardFn, float]], completions: Sequence[str],
          answers: Sequence[str]) -> Scores:
    """Runs every reward function and sums `weight * reward` per completion.

    A None among a function's values scores that completion 0 and is counted in
    `errors[name]`. A function that raises, returns the wrong number of values, or
    returns a non-finite value is retried sample by sample; each sample that still
    fails scores 0 and is counted in `errors[name]`. Nothing here raises for a faulty
    reward function.
    """
    check_pairs(completions, answers)
    total = np.zeros(len(completions))
    per_fn, errors = {}, {}
    for name, (fn, weight) in reward_fns.items():
        rewards, errors[name] = _run_reward(fn, name, completions, answers)
        per_fn[name] = rewards.astype(np.float32)
        total += weight * rewards
    return Scores(total.astype(np.float32), per_fn, errors)


def reward_details(reward_fns: Mapping[str, tuple[RewardFn, float]]) -> dict[str, float]:
    """`train-reward/func/<name>/<key>` for what each reward function with a `take_metrics()`
    counted since it was last asked (the `code` reward: programs by outcome, grading seconds)."""
    out = {}
    for name, (fn, _) in reward_fns.items():
        take = getattr(fn, "take_metrics", None)
        for key, value in (take() if take is not None else {}).items():
            out[f"train-reward/func/{name}/{key}"] = value
    return out
