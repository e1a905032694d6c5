"""Decode layouts a model's layers can run in, checked at config load.

The rollout's own decode step (`grpo_rollout.attention`: the default `decode_attention: rollout`,
its shared-prompt cascade and its model-parallel layout) and the model's cached forward
(`decode_attention: model`) run a family's sliding-window layers, post-norms and scaled
embeddings (Gemma 3). The head-parallel layout runs the plain layer only; partial rollouts and
kept multi-turn caches continue rows on compacted kept caches, whose slots are not aligned on
positions, not yet checked with a window. Each of those is refused in one line rather than run
without the window.
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
    gather = rollout.options.get("gather_weights", "auto")
    if gather == "head_parallel":
        raise UserError(f"rollout.options.gather_weights='head_parallel': {why}, which the head-parallel decode "
                        "step does not run; set rollout.options.gather_weights: auto (or model_parallel, true, false)")
    if rollout.partial.enabled:
        raise UserError(f"rollout.partial.enabled=true: {why}, and partial rollouts continue rows on compacted "
                        "kept caches not yet checked with a sliding window; set rollout.partial.enabled: false")
    if rollout.multi_turn.enabled and rollout.multi_turn.kv_cache != "reprefill":
        raise UserError(f"rollout.multi_turn.kv_cache={rollout.multi_turn.kv_cache!r}: {why}, and kept caches "
                        "are compacted and not yet checked with a sliding window; set rollout.multi_turn.kv_cache: "
                        "reprefill")
