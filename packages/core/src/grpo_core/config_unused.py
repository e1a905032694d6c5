"""Settings the chosen configuration does not read: refused when the config loads.

A key set away from its default while the feature that reads it is off would be accepted and
ignored (a CISPO cap under the clip loss, a mismatch threshold with no correction). Each is one
ConfigError naming the key, the value, what leaves it unused and the fix. A value equal to the
default (or to the value the loader fills in, as `--print-config` writes it) is not a setting,
so every printed or saved config loads back. The two keys the loader fills in from
rollout.max_new_tokens (loss.max_completion_length, rollout.partial.budget) are only warned about:
a saved config carries the filled value, and reloading it with another rollout.max_new_tokens
(`grpo-run eval --run-dir R rollout.max_new_tokens=N`) must keep working.
"""

from __future__ import annotations

import warnings
from typing import Any, Iterable, Optional

from grpo_core.errors import ConfigError


class UnusedSettingWarning(UserWarning):
    """A setting the configuration does not read, kept because a saved config may carry it."""


# loss.policy_loss -> the loss options only that policy loss reads (docs/losses.md)
POLICY_LOSS_KEYS = {"clip": ("epsilon_low", "epsilon_high"), "cispo": ("cispo_epsilon_max",),
                    "sapo": ("sapo_temperature_pos", "sapo_temperature_neg")}
TRAIN_BY_OPTIMIZER = ("weight_decay", "b1", "b2")  # adamw and lion read them, sgd does not
PARTIAL_KEYS = ("budget", "max_staleness", "budget_quantile", "slots", "kv_cache")


def refuse_unused(section: Any, prefix: str, names: Iterable[str], why: str, fix: str,
                  filled: Optional[dict] = None) -> None:
    """A ConfigError for the first of `names` whose value differs from its default (the section
    class's own): `why` says what leaves it unused, `fix` how to use it. A name in `filled` (its
    value the loader's fill) gets a warning instead (see the module doc)."""
    fresh = type(section)()
    for name in names:
        value, default = getattr(section, name), (filled or {}).get(name, getattr(fresh, name))
        if value == default:
            continue
        message = f"{prefix}.{name} = {value!r} is not used: {why}; {fix}, or remove {prefix}.{name}"
        if name not in (filled or {}):
            raise ConfigError(message)
        warnings.warn(message, UnusedSettingWarning, stacklevel=2)


def check_unused_loss(loss: Any, max_new_tokens: int) -> None:
    """Loss options of a policy loss, KL, mismatch correction, refill or aggregation not chosen."""
    for owner, names in POLICY_LOSS_KEYS.items():
        if owner != loss.policy_loss:
            refuse_unused(loss, "loss", names, f"loss.policy_loss = {loss.policy_loss!r} reads only its own options",
                          f"set loss.policy_loss={owner} to use it")
    if loss.beta == 0:
        refuse_unused(loss, "loss", ("kl_estimator", "kl_importance_weighted"), "loss.beta = 0 has no KL term",
                      "set loss.beta > 0 (e.g. 0.04)")
    if loss.mismatch_correction == "none":
        refuse_unused(loss, "loss", ("mismatch_level", "mismatch_c_max", "mismatch_c_min"),
                      "loss.mismatch_correction = 'none' corrects nothing", "set loss.mismatch_correction=truncate (or mask)")
    if not (loss.dynamic_sampling and loss.dynamic_sampling_mode == "refill"):
        refuse_unused(loss, "loss", ("max_extra_rollouts",), "only dynamic sampling's refill mode rolls out more",
                      "set loss.dynamic_sampling=true and loss.dynamic_sampling_mode=refill")
    if loss.aggregation != "fixed_length_norm":
        refuse_unused(loss, "loss", ("max_completion_length",), f"loss.aggregation = {loss.aggregation!r} has no "
                      "fixed length", "set loss.aggregation=fixed_length_norm",
                      filled={"max_completion_length": max_new_tokens})
    if loss.advantage_estimator != "grpo":
        refuse_unused(loss, "loss", ("scale_rewards",), f"loss.advantage_estimator = {loss.advantage_estimator!r} "
                      "scales advantages its own way (only grpo reads it)", "set loss.advantage_estimator=grpo")


def check_unused_train(train: Any) -> None:
    if train.optimizer == "sgd":
        refuse_unused(train, "train", TRAIN_BY_OPTIMIZER, "train.optimizer = 'sgd' has no moments or weight decay",
                      "set train.optimizer=adamw (or lion)")
    if train.schedule == "constant":
        refuse_unused(train, "train", ("min_lr_ratio",), "train.schedule = 'constant' does not decay",
                      "set train.schedule=cosine (or linear)")


def check_unused_partial(partial: Any, max_new_tokens: int) -> None:
    if not partial.enabled:
        refuse_unused(partial, "rollout.partial", PARTIAL_KEYS, "rollout.partial.enabled is false",
                      "set rollout.partial.enabled=true", filled={"budget": -(-max_new_tokens // 4)})
