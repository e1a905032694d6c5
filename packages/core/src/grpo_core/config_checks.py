"""Checks of a RunConfig's own fields, across sections (no plugin is asked: those checks are
`grpo_core.config_io.validate_plugins`): each refuses a combination no run could honour, in one
line naming the keys, the values and the fix, before anything is built."""

from __future__ import annotations

import difflib
import math
from typing import Any

from grpo_core.config import LORA_TARGETS, RunConfig
from grpo_core.config_teacher import check_teacher
from grpo_core.config_unused import check_unused_loss, check_unused_partial, check_unused_train
from grpo_core.errors import ConfigError
from grpo_core.multi_turn_checks import check_multi_turn


def finite(value: int | float) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an integer beyond the float range
        return False


def validate_cross_fields(cfg: RunConfig) -> None:
    """Constraints that involve more than one field."""
    for name, weight in cfg.task.rewards.items():
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not finite(weight):
            raise ConfigError(f"task.rewards.{name} = {weight!r} has the wrong type: expected a finite number "
                              "(the weight)")
    if cfg.model.param_dtype == "bfloat16" and cfg.model.dtype == "float32":
        raise ConfigError("model.param_dtype = bfloat16 with model.dtype = float32: float32 compute on bfloat16 "
                          "weights gains nothing; set model.param_dtype=float32 (or model.dtype=bfloat16)")
    _check_loss_options(cfg.loss)
    _check_lora(cfg.model.lora)
    _check_partial(cfg)
    check_unused_loss(cfg.loss, cfg.rollout.max_new_tokens)
    check_unused_train(cfg.train)
    check_unused_partial(cfg.rollout.partial, cfg.rollout.max_new_tokens)
    check_multi_turn(cfg)
    check_teacher(cfg)
    if not cfg.task.rewards:
        raise ConfigError("task.rewards is empty: name at least one reward function, e.g. {correctness: 1.0}")
    for name in cfg.task.reward_options:
        if name not in cfg.task.rewards:
            raise ConfigError(f"task.reward_options.{name} configures a reward that task.rewards does not use; "
                              f"add it to task.rewards or remove the options")


def _check_loss_options(loss: Any) -> None:
    if loss.policy_loss != "clip" and loss.epsilon_c is not None:
        raise ConfigError(f"loss.epsilon_c = {loss.epsilon_c} is the dual clip of the clipped surrogate, but "
                          f"loss.policy_loss = {loss.policy_loss!r} has none; set loss.epsilon_c=null")
    if loss.mismatch_c_min is not None and loss.mismatch_c_min > loss.mismatch_c_max:
        raise ConfigError(f"loss.mismatch_c_min = {loss.mismatch_c_min} is above loss.mismatch_c_max = "
                          f"{loss.mismatch_c_max}: every ratio would be truncated or masked; set c_min <= c_max")
    if loss.dynamic_sampling_mode == "refill" and not loss.dynamic_sampling:
        raise ConfigError("loss.dynamic_sampling_mode = 'refill' with loss.dynamic_sampling = false: refilling "
                          "replaces groups that dynamic sampling drops; set loss.dynamic_sampling=true")


def _check_partial(cfg: RunConfig) -> None:
    """Partial rollouts carry tokens drawn by older policies: the loss must correct them."""
    partial, max_new = cfg.rollout.partial, cfg.rollout.max_new_tokens
    if not partial.enabled:
        return
    if cfg.loss.mismatch_correction == "none":
        raise ConfigError("rollout.partial.enabled with loss.mismatch_correction = 'none': carried tokens were "
                          "sampled by older policies; set loss.mismatch_correction=truncate (or mask)")
    if cfg.rollout.use_sampler_logps:
        raise ConfigError("rollout.partial.enabled with rollout.use_sampler_logps = true: the old log-probs must "
                          "be the current policy's to correct carried tokens; set rollout.use_sampler_logps=false")
    if cfg.loss.dynamic_sampling and cfg.loss.dynamic_sampling_mode == "refill":
        raise ConfigError("rollout.partial.enabled with loss.dynamic_sampling_mode = 'refill': partial rollouts "
                          "already keep the slots full; set loss.dynamic_sampling_mode=mask")
    budget = partial.budget or -(-max_new // 4)
    if budget > max_new:
        raise ConfigError(f"rollout.partial.budget = {budget} is above rollout.max_new_tokens = {max_new}; "
                          f"set rollout.partial.budget <= {max_new}")
    rounds = -(-max_new // budget)
    if partial.max_staleness is not None and partial.budget_quantile is not None:
        raise ConfigError("rollout.partial.max_staleness with rollout.partial.budget_quantile: rounds shrink with "
                          "the recent lengths, so no staleness cap is sure to let the longest rows finish; set "
                          "one of them to null")
    _check_slots(cfg)
    if partial.max_staleness is not None and partial.max_staleness < rounds - 1:
        raise ConfigError(f"rollout.partial.max_staleness = {partial.max_staleness} is below {rounds - 1}: a row "
                          f"of {max_new} tokens spans {rounds} rounds of {budget} and could never finish; set "
                          f"rollout.partial.max_staleness >= {rounds - 1} (or null)")


def _check_slots(cfg: RunConfig) -> None:
    """rollout.partial.slots: a whole number of steps' rows, on single-turn rows."""
    slots, rows = cfg.rollout.partial.slots, cfg.rollout.prompts_per_step * cfg.rollout.n
    if slots is None:
        return
    if isinstance(slots, int) and slots % rows:
        nearest = " or ".join(str(m * rows) for m in (slots // rows, slots // rows + 1) if m)
        raise ConfigError(f"rollout.partial.slots = {slots} is not a multiple of the {rows} rows of a step "
                          f"(rollout.prompts_per_step x rollout.n); set it to {nearest} (or null)")
    if cfg.rollout.multi_turn.enabled:
        raise ConfigError(f"rollout.partial.slots = {slots!r} with rollout.multi_turn.enabled: carried multi-turn "
                          "rows have prompts_per_step x n slots; set rollout.partial.slots=null")


def _check_lora(lora: Any) -> None:
    if lora.rank is None:
        return
    for name in lora.target_modules:
        if name not in LORA_TARGETS:
            close = difflib.get_close_matches(str(name), LORA_TARGETS, n=1, cutoff=0.5)
            hint = f"did you mean {close[0]}?" if close else f"use some of {', '.join(LORA_TARGETS)}"
            raise ConfigError(f"model.lora.target_modules: unknown module {name!r}; {hint}")
    if not lora.target_modules:
        raise ConfigError(f"model.lora.target_modules is empty; name some of {', '.join(LORA_TARGETS)}")
    if lora.dropout > 0:
        raise ConfigError(f"model.lora.dropout = {lora.dropout} is not supported (adapter dropout is not "
                          "implemented); set model.lora.dropout=0")


def check_eval_reward(cfg: RunConfig) -> None:
    if cfg.eval.every_steps and cfg.eval.reward not in cfg.task.rewards:
        raise ConfigError(f"eval.reward = {cfg.eval.reward!r} is not one of task.rewards "
                          f"({', '.join(cfg.task.rewards)}); set eval.reward to one of them, or add it to "
                          f"task.rewards (weight 0 judges answers without training on it)")


def check_eval_k(eval_cfg: Any) -> None:
    """Each k of pass@k and maj@k is a whole number of samples out of eval.n (2.5 is not rounded)."""
    for k in eval_cfg.k:
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= eval_cfg.n:
            raise ConfigError(f"eval.k holds {k!r}: each k must be an integer in 1..eval.n = {eval_cfg.n}; "
                              "give whole numbers of samples no larger than eval.n, or raise eval.n")
