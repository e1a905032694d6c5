"""Warnings and notes about a config that loads but may not do what is meant; emitted once,
when the config loads (`config_io.load_config`), each from the sections it reads."""

from __future__ import annotations

import sys
import warnings

from grpo_core.config import LossConfig, ModelConfig, RolloutConfig, RunConfig, TrainConfig


class PrecisionWarning(UserWarning):
    """Training settings that silently lose updates."""


def warn_if_updates_round_away(model: ModelConfig, train: TrainConfig) -> None:
    """bfloat16 storage keeps 8 significant bits: an update below 0.2-0.4% of a weight rounds to nothing."""
    if model.param_dtype == "bfloat16":
        warnings.warn(f"model.param_dtype=bfloat16: updates smaller than 0.2-0.4% of a weight round away (a "
                      f"weight of 0.02 ignores steps below 6e-5; train.lr={train.lr:g}); watch "
                      "train-other/update_ratio, or set model.param_dtype=float32", PrecisionWarning, stacklevel=3)


def note_void_correction(loss: LossConfig, rollout: RolloutConfig) -> None:
    """One line when the mismatch correction is on but cannot do anything."""
    if loss.mismatch_correction != "none" and rollout.use_sampler_logps:
        print(f"grpo-run: note: loss.mismatch_correction = {loss.mismatch_correction} has nothing to correct: "
              "with rollout.use_sampler_logps: true the old log-probs are the sampler's, so every ratio is 1; "
              "set rollout.use_sampler_logps=false to correct the rollout/training mismatch", file=sys.stderr)


def config_notes(cfg: RunConfig) -> None:
    warn_if_updates_round_away(cfg.model, cfg.train)
    note_void_correction(cfg.loss, cfg.rollout)
