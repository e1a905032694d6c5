"""Decode layouts a model's layers can run in, checked at config load.

The rollout's own decode step (`grpo_rollout.attention`, and the shared-prompt cascade,
model-parallel and head-parallel layouts built on it) runs the plain pre-norm layer with
full attention. A model whose family differs there (Gemma 3: sliding-window layers,
post-norms, scaled embeddings) decodes through its own cached forward
(`rollout.options.decode_attention: model`), which honours the window; partial rollouts and
kept multi-turn caches continue rows on compacted kept caches, not yet checked with a window.
Each other choice is refused in one line rather than run without the window.
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
    attention = rollout.options.get("decode_attention", "rollout")
    if attention != "model":
        raise UserError(f"rollout.options.decode_attention={attention!r}: {why}, which the rollout's own decode "
                        "step and its shared-prompt, model-parallel and head-parallel layouts do not run; set "
                        "rollout.options.decode_attention: model")
    if rollout.partial.enabled:
        raise UserError(f"rollout.partial.enabled=true: {why}, and partial rollouts continue rows on compacted "
                        "kept caches not yet checked with a sliding window; set rollout.partial.enabled: false")
    if rollout.multi_turn.enabled and rollout.multi_turn.kv_cache != "reprefill":
        raise UserError(f"rollout.multi_turn.kv_cache={rollout.multi_turn.kv_cache!r}: {why}, and kept caches "
                        "are compacted and not yet checked with a sliding window; set rollout.multi_turn.kv_cache: "
                        "reprefill")
