"""What the loss receives beside the batch: old, reference and sampler log-probs and the
trained-rows mask, decided once from the config (`LogpSources`) and computed by one function
(`loss_inputs`) into one record (`LossInputs`).

With ratio r_t = pi_theta / pi_old (GRPO, Shao et al. 2024, arXiv:2402.03300, eq. 3):
  old       None on one on-policy epoch: the params have not moved since the rollout, so the
            loss takes stop_grad(log pi_theta) and r_t = 1 exactly (also for the mismatch
            correction); the sampler's log-probs when `rollout.use_sampler_logps`; else one
            forward pass of the rollout's weights (several epochs per rollout).
  reference log pi_ref of the KL term, scored when `loss.beta > 0`.
  sampler   the rollout's own log-probs, carried when the loss corrects the rollout/training
            mismatch (`loss.mismatch_correction`, truncated or masked importance sampling).
  keep [N]  1 on rows the loss trains on: the estimator's keep mask (dynamic sampling), times
            "finished" when `loss.mask_truncated_completions` (DAPO, Yu et al. 2025, arXiv:2503.14476).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Literal, Optional

import numpy as np

from grpo_core.config import LossConfig, RolloutConfig, TrainConfig

OldSource = Literal["none", "sampler", "scored"]


@dataclass(frozen=True)
class LogpSources:
    """Which log-probs the loss receives and where each comes from."""

    old: OldSource
    reference: bool
    sampler: bool
    mask_truncated: bool

    @classmethod
    def from_config(cls, train: TrainConfig, rollout: RolloutConfig, loss: LossConfig) -> "LogpSources":
        if rollout.use_sampler_logps:
            old: OldSource = "sampler"
        else:
            old = "scored" if train.ppo_epochs > 1 else "none"
        return cls(old, loss.beta > 0, loss.mismatch_correction != "none", loss.mask_truncated_completions)

    @property
    def has_old(self) -> bool:
        return self.old != "none"

    @property
    def scores(self) -> bool:
        """A scoring forward pass runs each step (old or reference log-probs)."""
        return self.old == "scored" or self.reference


@dataclass(frozen=True)
class LossInputs:
    """keep [N] float32 host values; old_logp / ref_logp / sampler_logp [N, C] or None."""

    keep: np.ndarray
    old_logp: Optional[Any] = None
    ref_logp: Optional[Any] = None
    sampler_logp: Optional[Any] = None


def trained_rows(sources: LogpSources, estimator_keep: Any, finished: Any) -> np.ndarray:
    """[N] float32 host values: the keep mask, without completions cut at max_new_tokens when asked."""
    keep = np.asarray(estimator_keep, np.float32)
    if sources.mask_truncated:
        keep = keep * np.asarray(finished).astype(np.float32)
    return keep


def loss_inputs(sources: LogpSources, estimator_keep: Any, finished: Any, sampler_logps: Callable[[], Any],
                score: Callable[[Any], Any], weights: Any, reference: Any) -> LossInputs:
    """The record for one batch. `sampler_logps()` gives the rollout's [N, C] log-probs placed for the
    update; `score(w)` scores the batch's completions with weights `w` (the rollout's `weights`,
    or the `reference` weights)."""
    old = {"none": lambda: None, "sampler": sampler_logps, "scored": lambda: score(weights)}[sources.old]()
    return LossInputs(keep=trained_rows(sources, estimator_keep, finished), old_logp=old,
                      ref_logp=score(reference) if sources.reference else None,
                      sampler_logp=sampler_logps() if sources.sampler else None)
