"""The per-token log-prob interface every loss implementation provides.

Its contract (`TokenLogps`, `TokenLogpsImpl`) lives in `grpo_core.contracts`, so that a
loss plugin depends on grpo-core alone; the names are re-exported here as before.
"""

from __future__ import annotations

import jax

from grpo_core.contracts import TokenLogps, TokenLogpsImpl

Array = jax.Array

__all__ = ["Array", "TokenLogps", "TokenLogpsImpl", "per_token_logps"]


def per_token_logps(impl: TokenLogpsImpl, hidden: Array, lm_head: Array, targets: Array,
                    temperature: float | Array = 1.0) -> Array:
    """log p(target) [B, T] float32 through `impl`, e.g. for old-policy or reference
    log-probs without materialising logits (wrap in `jax.lax.stop_gradient` or call
    outside `jax.grad` when used as a fixed baseline)."""
    return impl(hidden, lm_head, targets, temperature).logp
