"""`jax` implementation: the reference. Materialises float32 logits [B, T, V]."""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from grpo_core import NoOptions

from grpo_losses.logps import Array, TokenLogps


@dataclass(frozen=True)
class ReferenceLogps:
    """Plain `log_softmax` over full logits; differentiated by JAX autodiff.

    Memory grows with B * T * V (about 10 GB per float32 logits buffer at B=8,
    T=2048, V=151936), so it is the correctness baseline, not the training path.
    Sharding is left to GSPMD.
    """

    def __call__(self, hidden: Array, lm_head: Array, targets: Array, temperature: float | Array = 1.0,
                 *, entropy: bool = False) -> TokenLogps:
        logits = jnp.einsum("bth,hv->btv", hidden, lm_head, preferred_element_type=jnp.float32)
        logits = logits / jnp.asarray(temperature, jnp.float32)  # [B, T, V]
        log_z = jax.nn.logsumexp(logits, axis=-1)  # [B, T]
        target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
        if not entropy:
            return TokenLogps(target_logit - log_z)
        probs = jnp.exp(logits - log_z[..., None])
        return TokenLogps(target_logit - log_z, log_z - jnp.sum(probs * logits, axis=-1))


def build_reference(options: NoOptions) -> ReferenceLogps:
    """`LossSpec.factory` of the `jax` implementation."""
    del options
    return ReferenceLogps()
