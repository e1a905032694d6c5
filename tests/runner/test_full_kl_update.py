"""`teacher.estimator: full` in the jitted update: the exact reverse-KL term through the real step
(teacher states in the batch, the teacher's head beside them) against a direct dense computation,
its exact accumulation over micro-batches, the `jax` and `fused` implementations, and a teacher
equal to the student."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from grpo_core.config import LossConfig
from grpo_core.models import QwenConfig, init_from_config
from grpo_losses import FusedLogps, FusedOptions, ReferenceLogps
from grpo_losses.full_kl import FullKLTerm, dense_kl
from grpo_runner_gsm8k.training.step import UpdateBatch, completion_hidden, make_completion_hidden, make_update

ROWS, PROMPT, COMPLETION, VOCAB, TEMPERATURE, COEF = 8, 3, 5, 45, 0.8, 0.7
STUDENT = QwenConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                     num_attention_heads=2, num_key_value_heads=1, head_dim=16, tie_word_embeddings=True)
TEACHER = QwenConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                     num_attention_heads=2, num_key_value_heads=1, head_dim=8, tie_word_embeddings=False)
LOSS = LossConfig(max_completion_length=COMPLETION)
IMPLS = {"jax": ReferenceLogps(), "fused": FusedLogps(FusedOptions(block_size=8, time_block=4))}  # 8 does not divide 45


def split(qcfg: QwenConfig, seed: int):
    return nnx.split(init_from_config(qcfg, seed=seed))


def batch_with_teacher(teacher_graphdef, teacher_params, advantages: float = 0.0) -> UpdateBatch:
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(0, VOCAB, (ROWS, PROMPT + COMPLETION)), jnp.int32)
    lengths = rng.integers(1, COMPLETION + 1, ROWS)
    loss_mask = jnp.asarray(np.arange(COMPLETION)[None] < lengths[:, None], jnp.float32)
    attention = jnp.concatenate([jnp.ones((ROWS, PROMPT), jnp.int32), loss_mask.astype(jnp.int32)], axis=1)
    hidden = make_completion_hidden(teacher_graphdef)(teacher_params, ids, attention, prompt_width=PROMPT)
    head = nnx.merge(teacher_graphdef, teacher_params).lm_head_weight()
    return UpdateBatch(ids, attention, ids[:, PROMPT:], loss_mask, jnp.full((ROWS,), advantages, jnp.float32),
                       teacher_hidden=hidden, teacher_head=head, prompt_width=PROMPT)


def direct_gradient(graphdef, params, batch: UpdateBatch, divergence: str = "reverse"):
    """(coef * the token mean of the dense KL, its gradient), straight from the model's logits."""
    def loss(p):
        hidden, head = completion_hidden(graphdef, p, batch.input_ids, batch.attention_mask, PROMPT)
        kl = dense_kl(hidden, head, batch.teacher_hidden, batch.teacher_head, TEMPERATURE, divergence)
        return COEF * jnp.sum(kl * batch.loss_mask) / jnp.sum(batch.loss_mask)

    return jax.value_and_grad(loss)(params)


LR = 1e4  # so large that params - lr * gradient keeps the gradient's float32 digits (params are O(0.1))


def sgd_step(graphdef, params, batch, impl, micro_batches: int, divergence: str = "reverse"):
    """(the update's gradient, its metrics), read off one SGD step (no clipping)."""
    update = make_update(graphdef, impl, LOSS, optax.sgd(LR), TEMPERATURE, micro_batches, full_kl=FullKLTerm(COEF, divergence))
    donated = jax.tree.map(jnp.copy, params)  # the update donates its params
    new_params, _, metrics = update(donated, optax.sgd(LR).init(donated), batch)
    return jax.tree.map(lambda new, old: (old - new) / LR, new_params, params), metrics


@pytest.fixture(scope="module")
def setup():
    graphdef, params = split(STUDENT, 0)
    teacher_graphdef, teacher_params = split(TEACHER, 1)
    batch = batch_with_teacher(teacher_graphdef, teacher_params)
    return graphdef, params, batch, direct_gradient(graphdef, params, batch)


@pytest.mark.parametrize("impl,micro_batches", [("jax", 1), ("fused", 1), ("fused", 2)])
def test_the_update_takes_the_gradient_of_coef_times_the_mean_exact_kl(setup, impl, micro_batches):
    """Advantages 0 (distillation alone): the GRPO term is 0 and the whole gradient is the KL's.
    Micro-batches of 4 rows with uneven token counts divide by the one token total, as the loss does."""
    graphdef, params, batch, (value, expected) = setup
    gradient, metrics = sgd_step(graphdef, params, batch, IMPLS[impl], micro_batches)
    assert float(metrics["loss"]) == pytest.approx(float(value), rel=1e-5)  # sums of 26 f32 terms of order 1
    assert float(metrics["distill_full_kl"]) == pytest.approx(float(value) / COEF, rel=1e-5)
    scale = max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(expected))
    for got, want in zip(jax.tree.leaves(gradient), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * scale)


def test_a_teacher_equal_to_the_student_gives_zero_kl():
    graphdef, params = split(STUDENT, 0)
    batch = batch_with_teacher(graphdef, params)
    gradient, metrics = sgd_step(graphdef, params, batch, IMPLS["fused"], 1)
    assert abs(float(metrics["distill_full_kl"])) < 1e-6
    assert max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(gradient)) < 1e-6


def test_the_forward_divergence_takes_the_gradient_of_coef_times_the_mean_forward_kl(setup):
    """`teacher.divergence: forward` through the same update: the fused blockwise term over 2
    micro-batches against the dense KL(teacher || student) of the direct computation."""
    graphdef, params, batch, _ = setup
    value, expected = direct_gradient(graphdef, params, batch, "forward")
    gradient, metrics = sgd_step(graphdef, params, batch, IMPLS["fused"], 2, "forward")
    assert float(metrics["loss"]) == pytest.approx(float(value), rel=1e-5)
    scale = max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(expected))
    for got, want in zip(jax.tree.leaves(gradient), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * scale)
