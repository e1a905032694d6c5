"""The metrics of a training step that depend on which objective options are in use, and the
accelerator's memory: read off the update's outputs and the devices, for the step's log line."""

from __future__ import annotations

import jax
import numpy as np

from grpo_core.rollout_records import RolloutResult

from grpo_runner_gsm8k.multihost import host_array

OPTIONAL_TRAIN_METRICS = ("mismatch_kl", "mismatch_ratio_mean", "mismatch_ratio_max", "mismatch_rejected_frac",
                          "entropy_selected_frac", "cispo_capped_frac", "sapo_gate_mean",
                          "distill_full_kl")


def objective_metrics(train: dict, result: RolloutResult, loss_cfg) -> dict:
    """train-other/* metrics of the objective options in use (mismatch correction, entropy
    selection, cispo / sapo policy loss, truncated completions), and a mixture-of-experts
    model's router/* statistics."""
    out = {f"train-other/{name}": float(train[name]) for name in OPTIONAL_TRAIN_METRICS if name in train}
    out.update({name: float(value) for name, value in train.items() if name.startswith("router/")})
    if loss_cfg.mask_truncated_completions:
        out["train-other/truncated_frac"] = float(1.0 - np.mean(host_array(result.finished)))
    return out


def memory_metrics() -> dict:
    """Device memory where the backend reports it (TPU/GPU); CPU reports nothing."""
    stats = [d.memory_stats() for d in jax.local_devices()]
    if not stats or any(s is None for s in stats):
        return {}
    gib = float(1 << 30)
    return {"memory/train/bytes_in_use_max_gib": max(s.get("bytes_in_use", 0) for s in stats) / gib,
            "memory/train/peak_bytes_in_use_max_gib": max(s.get("peak_bytes_in_use", 0) for s in stats) / gib}
