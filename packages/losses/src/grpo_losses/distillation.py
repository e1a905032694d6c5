"""On-policy distillation: a teacher's per-token reverse KL as a token-level advantage.

The student samples completions y; a frozen teacher q scores every sampled token with the
same scorer as the policy (log_softmax(logits / T) of the sampled token, T the sampling
temperature). Per completion token t:

    d_t   = log pi(y_t | x, y_<t) - log q(y_t | x, y_<t)
    A_t   = -c * d_t                       (distillation alone)
    A_t   = A_row - c * d_t                (teacher.use_task_reward: added to the task's advantage)

and A_t = 0 outside the completion mask. With `teacher.baseline: leave_one_out`, d_t is replaced
by d_t - b_i, where b_i is the mean of d over the completion tokens of the other K - 1 rows of row
i's group (the K samples of its prompt). b_i does not depend on row i's own tokens, so the
expected gradient is unchanged (E[b grad log pi] = 0, the baseline argument of Williams 1992 and
the leave-one-out of Kool et al. 2019); it removes the part of d_t common to the group.

d_t is a one-sample estimate of the per-token reverse
KL(pi || q) at the prefix the student itself reached (Agarwal et al. 2024, "On-policy
distillation of language models: learning from self-generated mistakes" (GKD), with the
reverse KL as the divergence; Thinking Machines, "On-Policy Distillation", 2025, which uses the
negative per-token reverse KL as the advantage with a discount of zero). A_t carries no gradient:
with ratio 1 the policy-gradient term -A_t * grad log pi(y_t) is c * d_t * grad log pi(y_t), whose
expectation over y_t ~ pi is c * grad KL(pi || q) at that prefix (E[grad log pi] = 0).
The exact KL over the whole vocabulary, with nothing sampled, is `teacher.estimator: full`
(grpo_losses.full_kl).

Which student log-prob: the sampler's (the rollout's `sampler_logps`), i.e. log_softmax(logits / T)
of the policy that drew the token, unfiltered by top-k/top-p. Three reasons: d_t estimates the KL
of the distribution the tokens were actually drawn from (with partial rollouts a carried token
was drawn by an older policy, and its sampler log-prob is that policy's); the teacher's score uses
the same temperature, so both sides are the same quantity; and it costs no forward pass (with one
epoch the loop runs none for old log-probs).
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

Array = jax.Array


def reverse_kl_tokens(student_logp: Array, teacher_logp: Array, mask: Array) -> Array:
    """d_t = student_logp - teacher_logp [B, T], 0 where `mask` is 0 (padding may hold anything)."""
    return jnp.where(mask > 0, student_logp.astype(jnp.float32) - teacher_logp.astype(jnp.float32), 0.0)


def leave_one_out_baseline(kl_tokens: Array, mask: Array, group_size: int) -> Array:
    """b [B, 1]: the mean of `kl_tokens` over the completion tokens of the other rows of each row's
    group (rows i*K .. i*K + K - 1); 0 where those rows have no completion token."""
    mask = mask.astype(jnp.float32)
    sums, counts = jnp.sum(kl_tokens * mask, axis=1), jnp.sum(mask, axis=1)  # [B]
    group_sums = jnp.repeat(sums.reshape(-1, group_size).sum(axis=1), group_size)
    group_counts = jnp.repeat(counts.reshape(-1, group_size).sum(axis=1), group_size)
    others = group_counts - counts
    return jnp.where(others > 0, (group_sums - sums) / jnp.maximum(others, 1.0), 0.0)[:, None]


def distillation_advantages(row_advantages: Array, student_logp: Array, teacher_logp: Array, mask: Array,
                            coef: float, use_task_reward: bool, baseline_group_size: Optional[int] = None) -> Array:
    """A_t [B, T] of the module doc from the task's advantages (per row [B], broadcast over the
    tokens, or already per token [B, T]) and log-probs [B, T]; `baseline_group_size` K subtracts the
    leave-one-out baseline of groups of K consecutive rows (None: no baseline)."""
    kl_tokens = reverse_kl_tokens(student_logp, teacher_logp, mask)
    if baseline_group_size is not None:
        kl_tokens = kl_tokens - leave_one_out_baseline(kl_tokens, mask, baseline_group_size)
    token = -coef * kl_tokens
    if use_task_reward:
        task = row_advantages.astype(jnp.float32)
        token = token + (task if task.ndim == 2 else task[:, None])
    return jnp.where(mask > 0, token, 0.0)


def mean_reverse_kl(student_logp: Array, teacher_logp: Array, mask: Array) -> Array:
    """The masked mean of d_t over every completion token of the batch (a metric)."""
    mask = mask.astype(jnp.float32)
    return jnp.sum(reverse_kl_tokens(student_logp, teacher_logp, mask)) / jnp.maximum(jnp.sum(mask), 1.0)
