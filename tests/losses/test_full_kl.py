"""The exact full-vocabulary KL of on-policy distillation (grpo_losses.full_kl), reverse and
forward: the blockwise online computation against a direct dense one, value and gradient, for
vocabulary blocks that do and do not divide the vocabulary; a teacher equal to the student gives 0."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from grpo_losses import FusedLogps, FusedOptions, PallasLogps, PallasOptions, ReferenceLogps
from grpo_losses.full_kl import blockwise_kl, dense_kl, full_kl

VOCAB, HIDDEN, TEACHER_HIDDEN, TEMPERATURE = 7, 4, 3, 0.7


def direct_kl(hidden, head, teacher_hidden, teacher_head, divergence="reverse"):
    """sum_v p (log p - log q) (reverse) or sum_v q (log q - log p) (forward), written out with
    explicit softmaxes (float32 like the code under test)."""
    z_s = hidden @ head / TEMPERATURE
    z_t = teacher_hidden @ teacher_head / TEMPERATURE
    p = jnp.exp(z_s) / jnp.sum(jnp.exp(z_s), axis=-1, keepdims=True)
    q = jnp.exp(z_t) / jnp.sum(jnp.exp(z_t), axis=-1, keepdims=True)
    if divergence == "forward":
        return jnp.sum(q * (jnp.log(q) - jnp.log(p)), axis=-1)
    return jnp.sum(p * (jnp.log(p) - jnp.log(q)), axis=-1)


def exact_in_float64(hidden, head, teacher_hidden, teacher_head, weights, divergence="reverse"):
    """(sum_t w_t KL_t, its gradients w.r.t. hidden and head) in float64 numpy, the gradient from
    d KL_t / d z_s,v = p_v (log p_v - log q_v - KL_t) (reverse) or p_v - q_v (forward), and
    z_s = hidden . head / T."""
    hidden, head, weights = (np.asarray(x, np.float64) for x in (hidden, head, weights))
    z_s = hidden @ head / TEMPERATURE
    z_t = np.asarray(teacher_hidden, np.float64) @ np.asarray(teacher_head, np.float64) / TEMPERATURE
    log_p = z_s - np.log(np.sum(np.exp(z_s - z_s.max(-1, keepdims=True)), -1, keepdims=True)) - z_s.max(-1, keepdims=True)
    log_q = z_t - np.log(np.sum(np.exp(z_t - z_t.max(-1, keepdims=True)), -1, keepdims=True)) - z_t.max(-1, keepdims=True)
    if divergence == "forward":
        kl = np.sum(np.exp(log_q) * (log_q - log_p), -1)
        d_kl = np.exp(log_p) - np.exp(log_q)
    else:
        kl = np.sum(np.exp(log_p) * (log_p - log_q), -1)
        d_kl = np.exp(log_p) * (log_p - log_q - kl[..., None])
    d_z = weights[..., None] * d_kl / TEMPERATURE
    return np.sum(weights * kl), d_z @ head.T, np.einsum("bth,btv->hv", hidden, d_z)


def tiny(seed: int = 0):
    keys = jax.random.split(jax.random.key(seed), 5)
    hidden = jax.random.normal(keys[0], (2, 3, HIDDEN))
    head = jax.random.normal(keys[1], (HIDDEN, VOCAB))
    teacher_hidden = jax.random.normal(keys[2], (2, 3, TEACHER_HIDDEN))
    teacher_head = jax.random.normal(keys[3], (TEACHER_HIDDEN, VOCAB))
    weights = jax.random.uniform(keys[4], (2, 3))  # a cotangent per token, so every KL_t's gradient counts
    return hidden, head, teacher_hidden, teacher_head, weights


@pytest.mark.parametrize("divergence", ["reverse", "forward"])
@pytest.mark.parametrize("block_size", [1, 2, 3, 7, 64])  # 2 and 3 do not divide V = 7: the last block overlaps
def test_blockwise_value_and_gradient_equal_the_direct_computation(block_size, divergence):
    hidden, head, teacher_hidden, teacher_head, weights = tiny()

    def weighted(kl_fn):
        return lambda h, w: jnp.sum(weights * kl_fn(h, w))

    blockwise = weighted(lambda h, w: blockwise_kl(h, w, teacher_hidden, teacher_head, TEMPERATURE, block_size,
                                                   divergence))
    value, grads = jax.value_and_grad(blockwise, argnums=(0, 1))(hidden, head)
    expected_value, *expected_grads = exact_in_float64(hidden, head, teacher_hidden, teacher_head, weights, divergence)
    # float32 against the float64 truth; measured: 2e-8 relative on the value, 7e-7 of the largest gradient entry
    np.testing.assert_allclose(value, expected_value, rtol=1e-6)
    for got, expected in zip(grads, expected_grads):
        np.testing.assert_allclose(got, expected, rtol=0, atol=2e-6 * np.max(np.abs(expected)))
    np.testing.assert_allclose(blockwise_kl(hidden, head, teacher_hidden, teacher_head, TEMPERATURE, block_size, divergence),
                               direct_kl(hidden, head, teacher_hidden, teacher_head, divergence), rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("impl", [ReferenceLogps(), FusedLogps(FusedOptions(block_size=3)),
                                  PallasLogps(PallasOptions(block_size=128))], ids=["jax", "fused", "pallas"])
@pytest.mark.parametrize("divergence", ["reverse", "forward"])
def test_every_implementation_gives_the_dense_kl_and_its_gradient(impl, divergence):
    hidden, head, teacher_hidden, teacher_head, weights = tiny(1)

    def loss(h, w, fn):
        return jnp.sum(weights * fn(h, w, teacher_hidden, teacher_head, TEMPERATURE, divergence=divergence))

    got = jax.value_and_grad(loss, argnums=(0, 1))(hidden, head, lambda *a, **k: full_kl(impl, *a, **k))
    expected = jax.value_and_grad(loss, argnums=(0, 1))(hidden, head, dense_kl)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
        np.testing.assert_allclose(a, b, rtol=0, atol=2e-6 * float(jnp.max(jnp.abs(b))))


@pytest.mark.parametrize("divergence", ["reverse", "forward"])
def test_a_teacher_equal_to_the_student_gives_zero_kl_and_zero_gradient(divergence):
    hidden, head, _, _, weights = tiny(2)
    kl = lambda h, w: jnp.sum(weights * blockwise_kl(h, w, hidden, head, TEMPERATURE, 3, divergence))  # noqa: E731
    value, (d_hidden, d_head) = jax.value_and_grad(kl, argnums=(0, 1))(hidden, head)
    assert abs(float(value)) < 1e-6  # f32 rounding of log-sum-exps of order 10
    assert float(jnp.max(jnp.abs(d_hidden))) < 1e-6 and float(jnp.max(jnp.abs(d_head))) < 1e-6


def test_a_teacher_with_another_vocabulary_size_is_refused():
    hidden, head, teacher_hidden, teacher_head, _ = tiny()
    with pytest.raises(ValueError, match="the teacher's head has 6 vocabulary columns but the student's has 7"):
        blockwise_kl(hidden, head, teacher_hidden, teacher_head[:, :6])
