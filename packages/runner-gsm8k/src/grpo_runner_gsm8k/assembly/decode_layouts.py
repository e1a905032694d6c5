"""Decode layouts a model's layers can run in, checked at config load.

The rollout's own decode step (`grpo_rollout.attention`: the default `decode_attention: rollout`,
its shared-prompt cascade, its model-parallel and head-parallel layouts, the prompt table of partial
rollouts) and the model's cached forward (`decode_attention: model`) run a family's sliding-window
layers, post-norms and scaled embeddings (Gemma 3). The rollout's decode step counts the window in
positions, so it also serves kept caches (partial rollouts, multi-turn), whose rows may hold empty
slots between their tokens; the model's cached forward counts it in slots, right on rows whose
tokens fill their slots in order (prefilled afresh, or a tool turn appended right after the kept
tokens). Refused in one line rather than run without the window: kept caches decoded by the model's
forward with a sliding-window model (a kept row's slots end before those of the rows admitted beside it).
"""

from __future__ import annotations

from grpo_core.config import RolloutConfig
from grpo_core.errors import UserError
from grpo_core.models import QwenConfig


def check_decode_layouts(rollout: RolloutConfig, qcfg: QwenConfig) -> None:
    """UserError (one line) for a decode layout the model's layers cannot run in."""
    kept = kept_cache_setting(rollout)
    if kept is not None:
        refuse_model_decode(rollout, qcfg, *kept)


def check_stream_layout(rollout: RolloutConfig, qcfg: QwenConfig) -> None:
    """`grpo-run eval --stream`, whose slots continue on kept caches unless rollout.partial.kv_cache
    is reprefill (grpo_runner_gsm8k.samplers.partial.kv_cache_mode)."""
    if rollout.partial.kv_cache != "reprefill":
        refuse_model_decode(rollout, qcfg, "rollout.partial.kv_cache", rollout.partial.kv_cache, "--stream with ")


def refuse_model_decode(rollout: RolloutConfig, qcfg: QwenConfig, name: str, value: str, prefix: str = "") -> None:
    """UserError where rows on kept caches (`name`=`value`) would be decoded by the model's forward
    with a sliding-window model."""
    if qcfg.sliding_windows is None or rollout.backend != "jax":
        return
    if rollout.options.get("decode_attention", "rollout") == "model":
        raise UserError(f"{prefix}{name}={value!r} with decode_attention=model: model_type {qcfg.model_type!r} has "
                        "sliding-window layers, and the model's forward counts the window in slots, which kept rows "
                        f"do not fill in order; set rollout.options.decode_attention: rollout or {name}: reprefill")


def kept_cache_setting(rollout: RolloutConfig) -> tuple[str, str] | None:
    """(setting, value) under which rows continue on kept caches; None where every round prefills its
    rows afresh (multi-turn partial rollouts always do: grpo_core.multi_turn_checks)."""
    partial, multi = rollout.partial, rollout.multi_turn
    if partial.enabled and not multi.enabled and partial.kv_cache != "reprefill":
        return "rollout.partial.kv_cache", partial.kv_cache
    if multi.enabled and not partial.enabled and multi.kv_cache != "reprefill":
        return "rollout.multi_turn.kv_cache", multi.kv_cache
    return None
