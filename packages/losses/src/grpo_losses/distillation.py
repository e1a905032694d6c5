"""On-policy distillation: a teacher's per-token reverse KL as a token-level advantage.

The student samples completions y; a frozen teacher q scores every sampled token with the
same scorer as the policy (log_softmax(logits / T) of the sampled token, T the sampling
temperature). Per completion token t:

    d_t   = log pi(y_t | x, y_<t) - log q(y_t | x, y_<t)
    A_t   = -c * d_t                       (distillation alone)
    A_t   = A_row - c * d_t                (teacher.use_task_reward: added to the task's advantage)

and A_t = 0 outside the completion mask. d_t is a one-sample estimate of the per-token reverse
KL(pi || q) at the prefix the student itself reached (Agarwal et al. 2024, "On-policy
distillation of language models: learning from self-generated mistakes" (GKD), with the
reverse KL as the divergence; Thinking Machines, "On-Policy Distillation", 2025, which uses the
negative per-token reverse KL as the advantage with a discount of zero). A_t carries no gradient:
with ratio 1 the policy-gradient term -A_t * grad log pi(y_t) is c * d_t * grad log pi(y_t), whose
expectation over y_t ~ pi is c * grad KL(pi || q) at that prefix (E[grad log pi] = 0).

Which student log-prob: the sampler's (the rollout's `sampler_logps`), i.e. log_softmax(logits / T)
of the policy that drew the token, unfiltered by top-k/top-p. Three reasons: d_t estimates the KL
of the distribution the tokens were actually drawn from (with partial rollouts a carried token
was drawn by an older policy, and its sampler log-prob is that policy's); the teacher's score uses
the same temperature, so both sides are the same quantity; and it costs no forward pass (with one
epoch the loop runs none for old log-probs).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


def reverse_kl_tokens(student_logp: Array, teacher_logp: Array, mask: Array) -> Array:
    """d_t = student_logp - teacher_logp [B, T], 0 where `mask` is 0 (padding may hold anything)."""
    return jnp.where(mask > 0, student_logp.astype(jnp.float32) - teacher_logp.astype(jnp.float32), 0.0)


def distillation_advantages(row_advantages: Array, student_logp: Array, teacher_logp: Array, mask: Array,
                            coef: float, use_task_reward: bool) -> Array:
    """A_t [B, T] of the module doc from the task's advantages (per row [B], broadcast over the
    tokens, or already per token [B, T]) and log-probs [B, T]."""
    token = -coef * reverse_kl_tokens(student_logp, teacher_logp, mask)
    if use_task_reward:
        task = row_advantages.astype(jnp.float32)
        token = token + (task if task.ndim == 2 else task[:, None])
    return jnp.where(mask > 0, token, 0.0)


def mean_reverse_kl(student_logp: Array, teacher_logp: Array, mask: Array) -> Array:
    """The masked mean of d_t over every completion token of the batch (a metric)."""
    mask = mask.astype(jnp.float32)
    return jnp.sum(reverse_kl_tokens(student_logp, teacher_logp, mask)) / jnp.maximum(jnp.sum(mask), 1.0)
