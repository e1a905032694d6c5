"""On-policy distillation with an exact KL over the whole vocabulary (`teacher.estimator: full`).

At every completion position t of the student's own sample (Agarwal et al. 2024, "On-policy
distillation of language models: learning from self-generated mistakes" (GKD), reverse KL as the
divergence), with p = softmax(z_s) and q = softmax(z_t) for the student's and the teacher's
logits divided by the sampling temperature T:

    KL_t = sum_v p(v) (log p(v) - log q(v)) = E_p[z_s - z_t] - lse(z_s) + lse(z_t)      reverse
    KL_t = sum_v q(v) (log q(v) - log p(v)) = E_q[z_t - z_s] - lse(z_t) + lse(z_s)      forward

(`teacher.divergence`). The reverse KL is mode-seeking: its gradient on a logit is
p(v) (log p(v) - log q(v) - KL_t), small for a token the student rarely samples, however likely
the teacher finds it. The forward KL's is p(v) - q(v): the teacher's cross-entropy on the
student's own prefixes (GKD's forward-KL variant), which pulls the teacher's choice up at once
from a near-uniform student.

and the loss gains `coef * sum_t w_t KL_t / den`, w_t and den the objective's token weights and
denominator (for `token_mean`: the completion mask and the token count), so the term splits over
micro-batches exactly like the rest of the loss. It is differentiated through p only; the
teacher is frozen. Unlike the sampled estimate d_t = log p(y_t) - log q(y_t) it needs no
sampled token and has no variance: every vocabulary entry contributes at every position.

Blockwise (never [N, V]): over vocabulary blocks, an online log-sum-exp per token for each side
    m_s = running max of z_s,  S1 = sum exp(z_s - m_s),  S2 = sum exp(z_s - m_s) (z_s - z_t)
    m_t = running max of z_t,  St = sum exp(z_t - m_t),  St2 = sum exp(z_t - m_t) (z_t - z_s)
with S1, S2 (St, St2) rescaled by exp(m_old - m_new) when the max grows; then
    reverse KL = S2 / S1 - (m_s + log S1) + (m_t + log St)
    forward KL = St2 / St - (m_t + log St) + (m_s + log S1).
The running maxima are held out of the gradient: the value does not depend on them, and the
derivative of the rest is then exactly p's. Each block's body runs under `jax.checkpoint`, so
the backward keeps only the [N, 1] carries between blocks and recomputes each block's logits.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from grpo_losses.blockmath import F32, fold_blocks, fresh
from grpo_losses.logps import Array

DEFAULT_BLOCK = 2048  # the fused implementation's default vocab block
Divergence = Literal["reverse", "forward"]


class FullKLTerm(NamedTuple):
    """The update's exact-KL term: its weight and its direction (module doc)."""

    coef: float
    divergence: Divergence = "reverse"


class KLStats(NamedTuple):
    """Online state per token, float32 [N, 1] each (see module doc)."""

    m_s: Array
    s1: Array
    s2: Array
    m_t: Array
    st: Array
    st2: Array

    @classmethod
    def empty(cls, rows: int) -> KLStats:
        zeros, low = jnp.zeros((rows, 1), F32), jnp.full((rows, 1), -jnp.inf, F32)
        return cls(low, zeros, zeros, low, zeros, zeros)

    def kl(self, divergence: Divergence) -> Array:
        lse_s, lse_t = self.m_s + jnp.log(self.s1), self.m_t + jnp.log(self.st)
        if divergence == "forward":
            return self.st2 / self.st - lse_t + lse_s
        return self.s2 / self.s1 - lse_s + lse_t


def dense_kl(hidden: Array, lm_head: Array, teacher_hidden: Array, teacher_head: Array,
             temperature: float | Array = 1.0, divergence: Divergence = "reverse") -> Array:
    """KL(p || q) (reverse) or KL(q || p) (forward) per token [...] from hidden states [..., H] /
    [..., H_t] and heads [H, V] / [H_t, V], through float32 [..., V] logits (the reference)."""
    z_s = jnp.dot(hidden, lm_head, preferred_element_type=F32) / temperature
    z_t = lax.stop_gradient(jnp.dot(teacher_hidden, teacher_head, preferred_element_type=F32) / temperature)
    log_p, log_q = jax.nn.log_softmax(z_s, axis=-1), jax.nn.log_softmax(z_t, axis=-1)
    if divergence == "forward":
        return jnp.sum(jnp.exp(log_q) * (log_q - log_p), axis=-1)
    return jnp.sum(jnp.exp(log_p) * (log_p - log_q), axis=-1)


def blockwise_kl(hidden: Array, lm_head: Array, teacher_hidden: Array, teacher_head: Array,
                 temperature: float | Array = 1.0, block_size: int = DEFAULT_BLOCK,
                 divergence: Divergence = "reverse") -> Array:
    """`dense_kl` over vocabulary blocks of `block_size` columns (module doc); any shape
    [..., H] of hidden states, the same value and gradient, no [..., V] array."""
    lead = hidden.shape[:-1]
    h_s, h_t = hidden.reshape(-1, hidden.shape[-1]), lax.stop_gradient(teacher_hidden.reshape(-1, teacher_hidden.shape[-1]))
    w_t, inv_temp = lax.stop_gradient(teacher_head), 1.0 / jnp.asarray(temperature, F32)
    vocab = lm_head.shape[1]
    if teacher_head.shape[1] != vocab:
        raise ValueError(f"the teacher's head has {teacher_head.shape[1]} vocabulary columns but the student's has "
                         f"{vocab}; the full reverse KL needs one vocabulary (pad both heads to the same size)")
    width = min(block_size, vocab)

    @jax.checkpoint
    def block(acc: KLStats, start, skip) -> KLStats:
        new = fresh(skip, (1, width), 1)  # columns an earlier block already covered count once
        z_s = jnp.dot(h_s, lax.dynamic_slice_in_dim(lm_head, start, width, 1), preferred_element_type=F32) * inv_temp
        z_t = jnp.dot(h_t, lax.dynamic_slice_in_dim(w_t, start, width, 1), preferred_element_type=F32) * inv_temp
        return _fold(acc, z_s, z_t, new)

    return fold_blocks(block, KLStats.empty(h_s.shape[0]), vocab, block_size).kl(divergence).reshape(lead)


def _fold(acc: KLStats, z_s: Array, z_t: Array, new: Array) -> KLStats:
    """acc with one block of logits [N, W] folded in; `new` [1, W] marks the columns to count."""
    m_s = lax.stop_gradient(jnp.maximum(acc.m_s, jnp.max(jnp.where(new, z_s, -jnp.inf), axis=1, keepdims=True)))
    m_t = jnp.maximum(acc.m_t, jnp.max(jnp.where(new, z_t, -jnp.inf), axis=1, keepdims=True))
    e_s = jnp.where(new, jnp.exp(z_s - m_s), 0.0)  # finite: z <= the max of every column seen so far
    e_t = jnp.where(new, jnp.exp(z_t - m_t), 0.0)
    rescale_s, rescale_t = jnp.exp(acc.m_s - m_s), jnp.exp(acc.m_t - m_t)  # 0 on the first block
    gap = jnp.where(new, z_s - z_t, 0.0)
    return KLStats(m_s, acc.s1 * rescale_s + jnp.sum(e_s, axis=1, keepdims=True),
                   acc.s2 * rescale_s + jnp.sum(e_s * gap, axis=1, keepdims=True),
                   m_t, acc.st * rescale_t + jnp.sum(e_t, axis=1, keepdims=True),
                   acc.st2 * rescale_t - jnp.sum(e_t * gap, axis=1, keepdims=True))


def full_kl(impl, hidden: Array, lm_head: Array, teacher_hidden: Array, teacher_head: Array,
            temperature: float | Array = 1.0, divergence: Divergence = "reverse") -> Array:
    """KL_t [...] through the run's loss implementation `impl`: dense logits for the reference
    (`jax`, whose options have no block size), blockwise with the implementation's vocabulary
    block otherwise (`fused`, and `pallas`, whose kernels this term does not need)."""
    block = getattr(getattr(impl, "options", None), "block_size", None)
    if block is None:
        return dense_kl(hidden, lm_head, teacher_hidden, teacher_head, temperature, divergence)
    return blockwise_kl(hidden, lm_head, teacher_hidden, teacher_head, temperature, block, divergence)


def full_kl_numerator(impl, hidden: Array, lm_head: Array, teacher_hidden: Array, teacher_head: Array, mask: Array,
                      weights: Array, temperature: float | Array = 1.0,
                      divergence: Divergence = "reverse") -> tuple[Array, Array]:
    """(sum_t weights_t KL_t, the metric sum_t mask_t KL_t without gradient) over [B, T] tokens;
    `weights` are the objective's token weights, so that divided by its denominator the term is
    aggregated like the loss (module doc). Padding may hold any teacher state: it counts 0."""
    kl = jnp.where(mask > 0, full_kl(impl, hidden, lm_head, teacher_hidden, teacher_head, temperature, divergence), 0.0)
    return jnp.sum(weights * kl), jnp.sum(lax.stop_gradient(kl) * mask)
