"""`loss.policy_loss: cispo | sapo` against their papers' formulas written out directly
(loss, d loss / d logp, metrics), and every implementation (`fused` one-pass and
two-pass, `pallas`) against `jax` on loss, gradients w.r.t. hidden and lm_head and
metrics (float32, <= 1e-5 relative)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from grpo_core.config import LossConfig
from grpo_losses import (FusedLogps, FusedOptions, PallasLogps, PallasOptions, ReferenceLogps, aggregate,
                         finalize_loss, grpo_loss, token_losses)

TEMPERATURE = 0.8
REFERENCE = ReferenceLogps()
IMPLS = {
    "fused_one_pass": FusedLogps(FusedOptions(block_size=64, time_block=4, one_pass_time_block=4)),
    "fused_two_pass": FusedLogps(FusedOptions(block_size=64, time_block=4, one_pass=False)),
    "pallas": PallasLogps(PallasOptions(block_size=128, time_block=8)),
}
# cispo_epsilon_max 1.2 and the old log-probs' spread below: some weights are capped
CISPO = LossConfig(policy_loss="cispo", cispo_epsilon_max=1.2, compute_entropy=False)
SAPO = LossConfig(policy_loss="sapo", compute_entropy=False)


def math_inputs(seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    batch, time = 4, 6
    logp = rng.normal(size=(batch, time)) * 0.5 - 2.0
    mask = (np.arange(time)[None] < np.array([6, 3, 1, 5])[:, None]).astype(np.float32)
    return dict(logp=jnp.asarray(logp, jnp.float32), mask=jnp.asarray(mask),
                adv=jnp.asarray([0.9, -1.3, 0.4, -0.2], jnp.float32),
                token_adv=jnp.asarray(rng.normal(size=(batch, time)), jnp.float32),
                old=jnp.asarray(logp + rng.normal(size=(batch, time)) * 0.4, jnp.float32))


def ours(logp, x, adv, cfg: LossConfig, old):
    per_token, metrics = token_losses(logp, None, x["mask"], adv, old, None, cfg)
    return finalize_loss(*aggregate(per_token, x["mask"], cfg)), metrics


def direct_ratio(logp, old, mask, level: str):
    log_ratio = (logp - old) * mask
    if level == "sequence":
        return jnp.exp(log_ratio.sum(-1, keepdims=True) / mask.sum(-1, keepdims=True))
    return jnp.exp(log_ratio)


def direct_cispo(logp, old, mask, adv, eps_max: float, level: str):
    """MiniMax-M1: token mean of -sg(min(r, eps_max)) * A * logp."""
    weight = jax.lax.stop_gradient(jnp.minimum(direct_ratio(logp, old, mask, level), eps_max))
    return jnp.sum(-weight * adv * logp * mask) / jnp.sum(mask)


def direct_sapo(logp, old, mask, adv, tau_pos: float, tau_neg: float, level: str):
    """SAPO: token mean of -sigmoid(tau (r - 1)) * 4 / tau * A, tau by the sign of A."""
    tau = jnp.where(adv > 0, tau_pos, tau_neg)
    gate = 1.0 / (1.0 + jnp.exp(-tau * (direct_ratio(logp, old, mask, level) - 1.0)))
    return jnp.sum(-gate * 4.0 / tau * adv * mask) / jnp.sum(mask)


def advantages_of(x, kind: str):
    return x["adv"] if kind == "per_row" else x["token_adv"]


def direct_of(name: str, x, adv, level: str):
    column = adv[:, None] if adv.ndim == 1 else adv
    if name == "cispo":
        return lambda logp: direct_cispo(logp, x["old"], x["mask"], column, 1.2, level)
    return lambda logp: direct_sapo(logp, x["old"], x["mask"], column, 1.0, 1.05, level)


@pytest.mark.parametrize("adv_kind", ["per_row", "per_token"])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("name", ["cispo", "sapo"])
def test_matches_the_papers_formula(name, level, adv_kind):
    x = math_inputs()
    cfg = dataclasses.replace(CISPO if name == "cispo" else SAPO, importance_sampling_level=level)
    adv = advantages_of(x, adv_kind)
    (value, _), grad = jax.value_and_grad(ours, has_aux=True)(x["logp"], x, adv, cfg, x["old"])
    want, want_grad = jax.value_and_grad(direct_of(name, x, adv, level))(x["logp"])
    assert float(value) == pytest.approx(float(want), rel=1e-5)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-5, atol=1e-7)


def test_cispo_keeps_the_gradient_of_capped_tokens():
    """d loss / d logp = -min(r, eps_max) * A / tokens on every token, also where the weight is
    capped (where the clipped surrogate's gradient is 0)."""
    x = math_inputs(1)
    grad = jax.grad(lambda logp: ours(logp, x, x["adv"], CISPO, x["old"])[0])(x["logp"])
    ratio = np.exp(np.float64(x["logp"]) - np.float64(x["old"]))
    mask, adv = np.float64(x["mask"]), np.float64(x["adv"])[:, None]
    np.testing.assert_allclose(grad, -np.minimum(ratio, 1.2) * adv * mask / mask.sum(), rtol=1e-5, atol=1e-8)
    capped = (ratio > 1.2) & (mask > 0)
    assert capped.any() and np.all(np.asarray(grad)[capped] != 0)


def test_sapo_gradient_is_the_gated_policy_gradient():
    """d loss / d logp = -4 sigmoid (1 - sigmoid) * r * A / tokens (1 at r = 1, smaller away from it)."""
    x = math_inputs(2)
    grad = jax.grad(lambda logp: ours(logp, x, x["token_adv"], SAPO, x["old"])[0])(x["logp"])
    ratio = np.exp(np.float64(x["logp"]) - np.float64(x["old"]))
    mask, adv = np.float64(x["mask"]), np.float64(x["token_adv"])
    gate = 1.0 / (1.0 + np.exp(-np.where(adv > 0, 1.0, 1.05) * (ratio - 1.0)))
    np.testing.assert_allclose(grad, -4 * gate * (1 - gate) * ratio * adv * mask / mask.sum(), rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("cfg", [CISPO, SAPO], ids=["cispo", "sapo"])
def test_on_policy_gradient_is_the_policy_gradient(cfg):
    x = math_inputs(3)
    grad = jax.grad(lambda logp: ours(logp, x, x["adv"], cfg, None)[0])(x["logp"])
    np.testing.assert_allclose(grad, -x["adv"][:, None] * x["mask"] / jnp.sum(x["mask"]), rtol=1e-6)


def test_metrics_match_numpy():
    x = math_inputs(4)
    ratio = np.exp(np.float64(x["logp"]) - np.float64(x["old"]))
    valid, adv = np.asarray(x["mask"]) > 0, np.broadcast_to(np.float64(x["adv"])[:, None], ratio.shape)
    gate = 1.0 / (1.0 + np.exp(-np.where(adv > 0, 1.0, 1.05) * (ratio - 1.0)))
    cispo = ours(x["logp"], x, x["adv"], CISPO, x["old"])[1].summary()
    sapo = ours(x["logp"], x, x["adv"], SAPO, x["old"])[1].summary()
    assert 0 < float(cispo["cispo_capped_frac"]) < 1
    assert float(cispo["cispo_capped_frac"]) == pytest.approx((ratio > 1.2)[valid].mean(), rel=1e-6)
    assert float(sapo["sapo_gate_mean"]) == pytest.approx((4 * gate * (1 - gate))[valid].mean(), rel=1e-5)
    assert "cispo_capped_frac" not in sapo and "sapo_gate_mean" not in cispo


IMPL_CASES = {
    "cispo_token_kl_entropy": dataclasses.replace(CISPO, beta=0.05, entropy_coef=0.01, compute_entropy=True),
    "cispo_sequence": dataclasses.replace(CISPO, importance_sampling_level="sequence",
                                          aggregation="seq_mean_token_mean"),
    "sapo_token_mismatch": dataclasses.replace(SAPO, mismatch_correction="truncate", mismatch_c_max=1.1,
                                               aggregation="seq_mean_token_sum"),
    "sapo_sequence_entropy_selection": dataclasses.replace(SAPO, importance_sampling_level="sequence",
                                                           top_entropy_quantile=0.5),
}


def impl_problem(helpers):
    p = helpers.make_problem(3, 11, 12, 203, seed=41, lengths=[11, 6, 2])
    p.base_logp = jax.jit(lambda h, w, t: REFERENCE(h, w, t, TEMPERATURE).logp)(p.hidden, p.lm_head, p.targets)
    p.old = p.base_logp + p.old_noise
    p.token_adv = jnp.asarray(np.random.default_rng(6).normal(size=p.mask.shape), jnp.float32)
    return p


def loss_and_grads(impl, p, cfg: LossConfig) -> dict:
    def loss(hidden, lm_head):
        out = grpo_loss(impl, hidden, lm_head, p.targets, p.mask, p.token_adv, p.old, p.base_logp + p.ref_noise,
                        cfg, temperature=TEMPERATURE, sampler_logp=p.old + p.ref_noise)
        return out.loss, out

    (value, out), grads = jax.jit(jax.value_and_grad(loss, (0, 1), has_aux=True))(p.hidden, p.lm_head)
    return {"loss": value, "d_hidden": grads[0], "d_lm_head": grads[1], "metrics": out.metrics.summary()}


@pytest.mark.parametrize("case", list(IMPL_CASES))
@pytest.mark.parametrize("impl", list(IMPLS))
def test_implementations_agree_with_jax(helpers, impl, case):
    p = impl_problem(helpers)
    helpers.assert_tree_close(loss_and_grads(IMPLS[impl], p, IMPL_CASES[case]),
                              loss_and_grads(REFERENCE, p, IMPL_CASES[case]))


@pytest.mark.parametrize("policy_loss", ["cispo", "sapo"])
def test_dual_clip_is_refused(helpers, policy_loss):
    p = helpers.make_problem(1, 3, 4, 20)
    cfg = LossConfig(policy_loss=policy_loss, epsilon_c=3.0)
    with pytest.raises(ValueError, match=f"loss.epsilon_c = 3.0 is the dual clip .* loss.policy_loss = '{policy_loss}'"):
        grpo_loss(REFERENCE, p.hidden, p.lm_head, p.targets, p.mask, p.advantages, None, None, cfg)
