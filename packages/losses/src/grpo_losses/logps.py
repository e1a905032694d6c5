"""The per-token log-prob interface every loss implementation provides.

An implementation ("impl") maps hidden states and the LM-head weight to the
log-probability of each target token, `log_softmax(hidden @ lm_head / T)[target]`,
and optionally the entropy of that softmax. It is differentiable w.r.t. `hidden`
and `lm_head` (not w.r.t. `temperature`). How it gets there (materialised logits,
vocab blocks, Pallas kernels) is the implementation's business.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import jax

Array = jax.Array


class TokenLogps(NamedTuple):
    """Per-token results of an implementation, both float32 [B, T].

    logp:    log p(target) under softmax(logits / temperature).
    entropy: entropy of that softmax; None unless asked for with `entropy=True`.
    """

    logp: Array
    entropy: Array | None = None


class TokenLogpsImpl(Protocol):
    """What `LossSpec.factory(options)` returns.

    Call as `impl(hidden, lm_head, targets, temperature=1.0, *, entropy=False)`:
      hidden  [B, T, H] float32 or bfloat16
      lm_head [H, V]    same dtype family; V may be sharded over the `tp` mesh axis
      targets [B, T]    int, every entry in [0, V) (padding positions too; mask later)
      temperature       python float or scalar array (> 0)
    Returns `TokenLogps` (float32 [B, T]).
    """

    def __call__(self, hidden: Array, lm_head: Array, targets: Array, temperature: float | Array = 1.0,
                 *, entropy: bool = False) -> TokenLogps: ...


def per_token_logps(impl: TokenLogpsImpl, hidden: Array, lm_head: Array, targets: Array,
                    temperature: float | Array = 1.0) -> Array:
    """log p(target) [B, T] float32 through `impl`, e.g. for old-policy or reference
    log-probs without materialising logits (wrap in `jax.lax.stop_gradient` or call
    outside `jax.grad` when used as a fixed baseline)."""
    return impl(hidden, lm_head, targets, temperature).logp
