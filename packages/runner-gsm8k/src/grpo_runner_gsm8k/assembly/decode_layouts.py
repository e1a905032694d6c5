"""Decode layouts a model's layers can run in, checked at config load.

The rollout's own decode step (`grpo_rollout.attention`: the default `decode_attention: rollout`,
its shared-prompt cascade, its model-parallel and head-parallel layouts) and the model's cached forward
(`decode_attention: model`) run a family's sliding-window layers, post-norms and scaled
embeddings (Gemma 3). The rollout's decode step counts the window in positions, so it also
serves partial rollouts' kept caches, whose rows may hold empty slots between their tokens; the
model's cached forward counts it in slots (right on freshly prefilled rows only). Refused in one
line rather than run without the window: partial rollouts on the prompt table (shared_prompt) or
on kept caches decoded by the model's forward, and kept multi-turn caches (a tool turn appended to
a kept row runs the model's forward).
"""

from __future__ import annotations

from grpo_core.config import RolloutConfig
from grpo_core.errors import UserError
from grpo_core.models import QwenConfig


def check_decode_layouts(rollout: RolloutConfig, qcfg: QwenConfig) -> None:
    """UserError (one line) for a decode layout the model's layers cannot run in."""
    if qcfg.plain_decoder or rollout.backend != "jax":
        return
    why = f"model_type {qcfg.model_type!r} has sliding-window layers, post-norms or scaled embeddings"
    check_partial(rollout, why)
    if rollout.multi_turn.enabled and rollout.multi_turn.kv_cache != "reprefill":
        raise UserError(f"rollout.multi_turn.kv_cache={rollout.multi_turn.kv_cache!r}: {why}, and kept caches "
                        "are compacted and not yet checked with a sliding window; set rollout.multi_turn.kv_cache: "
                        "reprefill")


def check_partial(rollout: RolloutConfig, why: str) -> None:
    """Partial rollouts run with the window on the rollout's decode step without the prompt table, or
    on the model's forward when every round prefills its rows again (no kept cache)."""
    if not rollout.partial.enabled:
        return
    attention = rollout.options.get("decode_attention", "rollout")
    if attention == "rollout" and rollout.options.get("shared_prompt", True):
        raise UserError(f"rollout.partial.enabled=true with rollout.options.shared_prompt=true: {why}, which "
                        "partial rollouts on the shared prompt table do not run; set rollout.options.shared_prompt: "
                        "false")
    if attention == "model" and rollout.partial.kv_cache != "reprefill":
        raise UserError(f"rollout.partial.kv_cache={rollout.partial.kv_cache!r} with decode_attention=model: {why}, "
                        "and the model's forward counts the window in slots, which kept rows do not fill in order; "
                        "set rollout.options.decode_attention: rollout or rollout.partial.kv_cache: reprefill")
