"""Per-token factors on the policy-gradient term: rollout/training mismatch
correction and high-entropy token selection. Both are constants of the step
(no gradient flows through them) and multiply the clipped surrogate only, not
the KL or entropy terms.

Mismatch correction (Yao et al. 2025, truncated / masked importance sampling).
The sampler's log-probs differ from the training forward's, so the rollout is
slightly off-policy w.r.t. the old training policy. With
    log rho = old_logp - sampler_logp       (per token, 0 on masked positions)
and at `mismatch_level: sequence` log rho = sum_t log rho_t over the sequence's
unmasked tokens (the summed log-ratio, i.e. the sequence likelihood ratio, shared
by all its tokens), the weight is
    truncate:  clip(rho, c_min, c_max)           (c_min = 0 when null)
    mask:      rho * 1[c_min <= rho <= c_max]
and `old_logp` is stop_grad(logp) when the caller passes none (a single update:
the params have not moved since the rollout, so that is the old training logp).
Metrics, token-weighted: k3 estimate of KL(sampler || train) from the per-token
log-ratio (rho_t - 1 - log rho_t), mean and max of rho at the configured level,
fraction of tokens whose weight was truncated or masked.

High-entropy token selection (Wang et al. 2025, "Beyond the 80/20 rule"): a
token is trained on when its policy entropy is at least the (1 - q) quantile
(linear interpolation) of the entropies of the micro-batch's unmasked tokens.
The denominators keep counting every token, so exact gradient accumulation
holds; the threshold is per micro-batch (the whole rollout batch when
`train.micro_batch_size_per_device` is 0).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from grpo_core.config import LossConfig

from grpo_losses.logps import Array

F32 = jnp.float32


class MismatchWeights(NamedTuple):
    """weight: factor on the policy-gradient term, [B, T] or [B, 1] (sequence level);
    ratio: rho at the configured level, broadcast like weight; rejected: bool, rho was
    truncated or masked; token_kl: [B, T] k3 estimate of KL(sampler || train)."""

    weight: Array
    ratio: Array
    rejected: Array
    token_kl: Array


def mismatch_weights(train_logp: Array, sampler_logp: Array | None, mask: Array, cfg: LossConfig) -> MismatchWeights:
    """The correction of `cfg.mismatch_correction` (see module doc); train_logp is the
    old training policy's log-prob (treated as a constant)."""
    if sampler_logp is None:
        raise ValueError(f"loss.mismatch_correction is {cfg.mismatch_correction!r} but sampler_logp is None; pass "
                         "the sampler's per-token log-probs or set loss.mismatch_correction: none")
    token_log_rho = jnp.where(mask > 0, jax.lax.stop_gradient(train_logp) - sampler_logp, 0.0)
    log_rho = token_log_rho
    if cfg.mismatch_level == "sequence":
        log_rho = jnp.sum(token_log_rho, axis=-1, keepdims=True)
    rho = jnp.exp(log_rho)
    low = 0.0 if cfg.mismatch_c_min is None else cfg.mismatch_c_min
    inside = (rho >= low) & (rho <= cfg.mismatch_c_max)
    if cfg.mismatch_correction == "truncate":
        weight = jnp.clip(rho, low, cfg.mismatch_c_max)
    elif cfg.mismatch_correction == "mask":
        weight = jnp.where(inside, rho, 0.0)  # where, not a product: rho may be inf outside
    else:
        raise ValueError(f"loss.mismatch_correction must be none, truncate or mask, got {cfg.mismatch_correction!r}")
    token_kl = jnp.exp(token_log_rho) - token_log_rho - 1.0
    return MismatchWeights(weight, rho, ~inside, token_kl)


def high_entropy_tokens(entropy: Array, mask: Array, quantile: float) -> Array:
    """[B, T] float32: 1 on unmasked tokens whose entropy is in the top `quantile`
    fraction of the unmasked tokens' entropies (see module doc)."""
    entropy = jax.lax.stop_gradient(entropy)
    threshold = jnp.nanquantile(jnp.where(mask > 0, entropy, jnp.nan), 1.0 - quantile)
    return ((entropy >= threshold) & (mask > 0)).astype(F32)
