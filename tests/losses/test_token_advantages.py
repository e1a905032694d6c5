"""Advantages per token [B, T]: constant along each row they equal per-row advantages [B]
(loss, gradients w.r.t. hidden and lm_head, metrics; every implementation, float32 <= 1e-5
relative against `jax` with per-row advantages), and varying along the row they match the
per-token clipped surrogate written out directly, at token and sequence (GSPO) level."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from grpo_core.config import LossConfig
from grpo_losses import FusedLogps, FusedOptions, PallasLogps, PallasOptions, ReferenceLogps, grpo_loss

TEMPERATURE = 0.8
REFERENCE = ReferenceLogps()
IMPLS = {
    "jax": REFERENCE,
    "fused_one_pass": FusedLogps(FusedOptions(block_size=64, time_block=4, one_pass_time_block=4)),
    "fused_two_pass": FusedLogps(FusedOptions(block_size=64, time_block=4, one_pass=False)),
    "pallas": PallasLogps(PallasOptions(block_size=128, time_block=8)),
}
CONFIGS = {
    "token_kl": LossConfig(epsilon_high=0.28, beta=0.05, entropy_coef=0.01),
    "gspo": LossConfig(importance_sampling_level="sequence", aggregation="seq_mean_token_mean"),
    "mismatch_entropy_selection": LossConfig(mismatch_correction="truncate", mismatch_c_max=1.1,
                                             top_entropy_quantile=0.5, aggregation="seq_mean_token_sum"),
}


def problem(helpers):
    # 11 tokens per row against token blocks of 4/8, vocab 203 against blocks of 64/128, padding
    p = helpers.make_problem(3, 11, 12, 203, seed=31, lengths=[11, 6, 2])
    p.base_logp = jax.jit(lambda h, w, t: REFERENCE(h, w, t, TEMPERATURE).logp)(p.hidden, p.lm_head, p.targets)
    p.old = p.base_logp + p.old_noise  # ratios straddle the clip range
    p.sampler = p.old + p.ref_noise
    return p


def loss_and_grads(impl, p, cfg: LossConfig, advantages) -> dict:
    def loss(hidden, lm_head):
        out = grpo_loss(impl, hidden, lm_head, p.targets, p.mask, advantages, p.old, p.base_logp + p.ref_noise, cfg,
                        temperature=TEMPERATURE, sampler_logp=p.sampler)
        return out.loss, out

    (value, out), grads = jax.jit(jax.value_and_grad(loss, (0, 1), has_aux=True))(p.hidden, p.lm_head)
    return {"loss": value, "d_hidden": grads[0], "d_lm_head": grads[1], "metrics": out.metrics.summary()}


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("impl", list(IMPLS))
def test_constant_token_advantages_equal_row_advantages(helpers, impl, config):
    p = problem(helpers)
    per_token = jnp.broadcast_to(p.advantages[:, None], p.mask.shape)
    helpers.assert_tree_close(loss_and_grads(IMPLS[impl], p, CONFIGS[config], per_token),
                              loss_and_grads(REFERENCE, p, CONFIGS[config], p.advantages))


def direct_loss(hidden, lm_head, p, advantages, level: str):
    """token_mean of -min(r * A_t, clip(r, 0.8, 1.28) * A_t), r per token or GSPO's per sequence."""
    logits = jnp.einsum("bth,hv->btv", hidden, lm_head) / TEMPERATURE
    logp = jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), p.targets[..., None], axis=-1)[..., 0]
    log_ratio = (logp - p.old) * p.mask
    if level == "sequence":
        log_ratio = log_ratio.sum(-1, keepdims=True) / p.mask.sum(-1, keepdims=True)
    ratio = jnp.exp(log_ratio)
    per_token = -jnp.minimum(ratio * advantages, jnp.clip(ratio, 0.8, 1.28) * advantages)
    return jnp.sum(per_token * p.mask) / jnp.sum(p.mask)


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("impl", list(IMPLS))
def test_varying_token_advantages_match_the_direct_formula(helpers, impl, level):
    p = problem(helpers)
    # signs change inside rows, so a row-level sign in the clip would differ
    advantages = jnp.asarray(np.random.default_rng(3).normal(size=p.mask.shape), jnp.float32)
    cfg = LossConfig(epsilon_high=0.28, importance_sampling_level=level, compute_entropy=False)
    got = loss_and_grads(IMPLS[impl], p, cfg, advantages)
    value, grads = jax.jit(jax.value_and_grad(lambda h, w: direct_loss(h, w, p, advantages, level), (0, 1)))(
        p.hidden, p.lm_head)
    helpers.assert_tree_close((got["loss"], got["d_hidden"], got["d_lm_head"]), (value, *grads))


def test_advantages_of_another_shape_are_refused(helpers):
    p = helpers.make_problem(2, 5, 8, 40)
    with pytest.raises(ValueError, match=r"advantages have shape \(2, 4\) but the mask is \(2, 5\)"):
        grpo_loss(REFERENCE, p.hidden, p.lm_head, p.targets, p.mask, jnp.zeros((2, 4)), None, None, LossConfig())
