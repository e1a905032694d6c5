"""On-policy distillation's token-level advantages (grpo_losses.distillation): worked by hand,
the loss and gradient they give against a direct computation on a tiny vocabulary, and the
expected gradient over the sampled token against the exact gradient of the reverse KL."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from grpo_core.config import LossConfig
from grpo_losses import FusedLogps, FusedOptions, PallasLogps, PallasOptions, ReferenceLogps, grpo_loss
from grpo_losses.distillation import distillation_advantages, mean_reverse_kl

IMPLS = {  # vocabulary and token blocks smaller and larger than the tiny problem
    "jax": ReferenceLogps(),
    "fused_one_pass": FusedLogps(FusedOptions(block_size=2, time_block=2, one_pass_time_block=2)),
    "fused_two_pass": FusedLogps(FusedOptions(block_size=64, time_block=4, one_pass=False)),
    "pallas": PallasLogps(PallasOptions(block_size=128, time_block=8)),
}
VOCAB, HIDDEN, TEMPERATURE = 5, 3, 0.7


def test_advantages_worked_by_hand():
    student = jnp.asarray([[-1.0, -2.0, -0.5], [-3.0, -1.0, -9.0]])
    teacher = jnp.asarray([[-1.5, -1.0, -0.5], [-2.0, -4.0, 7.0]])
    mask = jnp.asarray([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])  # the last token of row 1 is padding
    rows = jnp.asarray([0.25, -2.0])
    alone = distillation_advantages(rows, student, teacher, mask, 2.0, use_task_reward=False)
    # -2 * (s - t): (0.5, -1, 0) and (-1, 3, padding)
    np.testing.assert_array_equal(alone, [[-1.0, 2.0, 0.0], [2.0, -6.0, 0.0]])
    added = distillation_advantages(rows, student, teacher, mask, 2.0, use_task_reward=True)
    np.testing.assert_array_equal(added, [[-0.75, 2.25, 0.25], [0.0, -8.0, 0.0]])
    # (0.5 - 1 + 0 - 1 + 3) / 5 tokens
    assert float(mean_reverse_kl(student, teacher, mask)) == pytest.approx(0.3, rel=1e-6)


def log_probs(hidden, head, targets):
    """log_softmax(hidden @ head / T) at `targets`, written out directly."""
    logits = jnp.einsum("bth,hv->btv", hidden, head) / TEMPERATURE
    return jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), targets[..., None], axis=-1)[..., 0]


def tiny_batch(seed: int = 0):
    keys = jax.random.split(jax.random.key(seed), 4)
    hidden = jax.random.normal(keys[0], (2, 3, HIDDEN))
    student_head, teacher_head = jax.random.normal(keys[1], (HIDDEN, VOCAB)), jax.random.normal(keys[2], (HIDDEN, VOCAB))
    targets = jax.random.randint(keys[3], (2, 3), 0, VOCAB)
    mask = jnp.asarray([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    return hidden, student_head, teacher_head, targets, mask


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("use_task_reward", [False, True])
def test_loss_and_gradient_equal_a_direct_computation(impl, use_task_reward):
    hidden, head, teacher_head, targets, mask = tiny_batch()
    rows, coef = jnp.asarray([0.5, -1.5]), 0.3
    student_logp = log_probs(hidden, head, targets)  # the sampler's, on policy: the same distribution
    teacher_logp = log_probs(hidden, teacher_head, targets)
    advantages = distillation_advantages(rows, student_logp, teacher_logp, mask, coef, use_task_reward)

    def ours(h, w):
        out = grpo_loss(IMPLS[impl], h, w, targets, mask, advantages, None, None, LossConfig(),
                        temperature=TEMPERATURE)
        return out.numerator / out.denominator

    def direct(h, w):
        # one epoch on policy: the ratio is 1 and its gradient is that of logp
        a = -coef * (student_logp - teacher_logp) + (rows[:, None] if use_task_reward else 0.0)
        logp = log_probs(h, w, targets)
        return -jnp.sum(mask * a * (logp - jax.lax.stop_gradient(logp) + 1.0)) / jnp.sum(mask)

    value, grads = jax.value_and_grad(ours, argnums=(0, 1))(hidden, head)
    expected, expected_grads = jax.value_and_grad(direct, argnums=(0, 1))(hidden, head)
    np.testing.assert_allclose(value, expected, rtol=1e-5)
    for got, want in zip(grads, expected_grads):  # f32: 1e-5 of the largest entry (small ones are sums that cancel)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(want))))


@pytest.mark.parametrize("impl", list(IMPLS))
def test_expected_gradient_is_the_reverse_kl_gradient(impl):
    """At one position, sum over every token y of pi(y) x the loss gradient with y sampled equals
    coef x grad KL(pi || q): the per-token advantage is an unbiased reverse-KL policy gradient."""
    hidden, head, teacher_head, _, _ = tiny_batch(1)
    hidden, coef = hidden[:1, :1], 0.3  # [1, 1, H]
    mask = jnp.ones((1, 1))

    def reverse_kl(w):
        logits = jnp.einsum("bth,hv->btv", hidden, w) / TEMPERATURE
        log_pi = jax.nn.log_softmax(logits)
        log_q = jax.nn.log_softmax(jnp.einsum("bth,hv->btv", hidden, teacher_head) / TEMPERATURE)
        return jnp.sum(jnp.exp(log_pi) * (log_pi - log_q))

    pi = jax.nn.softmax(jnp.einsum("bth,hv->btv", hidden, head)[0, 0] / TEMPERATURE)
    expected = jnp.zeros_like(head)
    for token in range(VOCAB):
        targets = jnp.full((1, 1), token)
        advantages = distillation_advantages(jnp.zeros(1), log_probs(hidden, head, targets),
                                             log_probs(hidden, teacher_head, targets), mask, coef, False)
        grad = jax.grad(lambda w: grpo_loss(IMPLS[impl], hidden, w, targets, mask, advantages, None, None, LossConfig(),
                                            temperature=TEMPERATURE).numerator)(head)
        expected = expected + pi[token] * grad
    exact = coef * jax.grad(reverse_kl)(head)
    np.testing.assert_allclose(expected, exact, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(exact))))


def test_leave_one_out_baseline_worked_by_hand():
    """Groups of 2 rows: each row's baseline is the mean d over the other row's completion tokens."""
    student = jnp.asarray([[1.0, 3.0], [2.0, 50.0], [4.0, 0.0], [9.0, 9.0]])
    teacher = jnp.zeros((4, 2))
    mask = jnp.asarray([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0], [0.0, 0.0]])  # row 3 is masked out
    rows = jnp.asarray([0.5, 0.5, -1.0, 0.0])
    # baselines: row 0 <- row 1's (2); row 1 <- row 0's (1 + 3) / 2; row 2 <- none (0); row 3 <- row 2's
    alone = distillation_advantages(rows, student, teacher, mask, 1.0, False, baseline_group_size=2)
    np.testing.assert_array_equal(alone, [[1.0, -1.0], [0.0, 0.0], [-4.0, 0.0], [0.0, 0.0]])
    added = distillation_advantages(rows, student, teacher, mask, 1.0, True, baseline_group_size=2)
    np.testing.assert_array_equal(added, [[1.5, -0.5], [0.5, 0.0], [-5.0, -1.0], [0.0, 0.0]])


def test_leave_one_out_baseline_keeps_the_expected_gradient():
    """A group of two one-token rows at one prompt: summed over every pair of sampled tokens
    (y1, y2) with probability pi(y1) pi(y2), the gradient with the baseline equals the gradient
    without it (both coef x grad KL(pi || q)): the baseline adds no bias."""
    hidden, head, teacher_head, _, _ = tiny_batch(2)
    hidden, coef, mask = jnp.repeat(hidden[:1, :1], 2, axis=0), 0.3, jnp.ones((2, 1))  # [2, 1, H]: one prompt
    pi = jax.nn.softmax(jnp.einsum("h,hv->v", hidden[0, 0], head) / TEMPERATURE)

    def expected_gradient(group_size):
        total = jnp.zeros_like(head)
        for first in range(VOCAB):
            for second in range(VOCAB):
                targets = jnp.asarray([[first], [second]])
                advantages = distillation_advantages(jnp.zeros(2), log_probs(hidden, head, targets),
                                                     log_probs(hidden, teacher_head, targets), mask, coef, False,
                                                     baseline_group_size=group_size)
                grad = jax.grad(lambda w: grpo_loss(IMPLS["jax"], hidden, w, targets, mask, advantages, None, None,
                                                    LossConfig(), temperature=TEMPERATURE).numerator)(head)
                total = total + pi[first] * pi[second] * grad
        return total

    without, with_baseline = expected_gradient(None), expected_gradient(2)
    np.testing.assert_allclose(with_baseline, without, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(without))))
    assert float(jnp.max(jnp.abs(without))) > 1e-3  # the gradient compared is not trivially zero
