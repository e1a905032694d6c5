"""Mismatch correction (TIS / MIS, token and sequence level) and high-entropy token
selection against formulas written out in numpy (float64): loss, gradients w.r.t.
hidden and lm_head, and metrics, for the `jax`, `fused` (one-pass and two-pass) and
`pallas` implementations (float32, <= 1e-5 relative)."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from grpo_core.config import LossConfig
from grpo_losses import FusedLogps, FusedOptions, PallasLogps, PallasOptions, ReferenceLogps, grpo_loss

TEMPERATURE = 0.8
IMPLS = {
    "jax": ReferenceLogps(),
    "fused_one_pass": FusedLogps(FusedOptions(block_size=64, time_block=4, one_pass_time_block=4)),
    "fused_two_pass": FusedLogps(FusedOptions(block_size=64, time_block=4, one_pass=False)),
    "pallas": PallasLogps(PallasOptions(block_size=128, time_block=8)),
}
BASE = LossConfig(compute_entropy=False, epsilon_low=0.2, epsilon_high=0.28)
CASES = {
    "tis_token": dict(mismatch_correction="truncate", mismatch_c_max=1.1),
    "tis_token_cmin": dict(mismatch_correction="truncate", mismatch_c_min=0.9, mismatch_c_max=1.2),
    "mis_token": dict(mismatch_correction="mask", mismatch_c_min=0.8, mismatch_c_max=1.25),
    "tis_sequence": dict(mismatch_correction="truncate", mismatch_level="sequence", mismatch_c_max=1.5),
    "mis_sequence": dict(mismatch_correction="mask", mismatch_level="sequence", mismatch_c_min=0.5,
                         mismatch_c_max=3.5),
    "entropy_top30": dict(top_entropy_quantile=0.3),
    "entropy_and_mis": dict(top_entropy_quantile=0.5, mismatch_correction="mask", mismatch_c_max=1.25),
}


def problem(helpers):
    p = helpers.make_problem(4, 11, 12, 203, seed=21, lengths=[11, 6, 2, 9])
    p.base_logp = numpy_forward(p)[0].astype(np.float32)
    rng = np.random.default_rng(5)
    p.old = p.base_logp + 0.3 * rng.normal(size=p.base_logp.shape).astype(np.float32)
    p.sampler = p.old + 0.3 * rng.normal(size=p.base_logp.shape).astype(np.float32)
    return p


def numpy_forward(p):
    """(logp [B, T], entropy [B, T], probs [B, T, V]) in float64."""
    z = np.einsum("bth,hv->btv", np.float64(p.hidden), np.float64(p.lm_head)) / TEMPERATURE
    z = z - z.max(-1, keepdims=True)
    probs = np.exp(z) / np.exp(z).sum(-1, keepdims=True)
    logp = np.log(np.take_along_axis(probs, np.asarray(p.targets)[..., None], -1)[..., 0])
    return logp, -(probs * np.log(probs)).sum(-1), probs


def numpy_weights(cfg: LossConfig, old, sampler, mask):
    """(TIS/MIS weight, rho, rejected, per-token k3 KL(sampler || train)) as published."""
    token_log_rho = (old - sampler) * mask
    log_rho = token_log_rho.sum(-1, keepdims=True) if cfg.mismatch_level == "sequence" else token_log_rho
    rho = np.broadcast_to(np.exp(log_rho), mask.shape)
    c_min = cfg.mismatch_c_min or 0.0
    inside = (c_min <= rho) & (rho <= cfg.mismatch_c_max)
    weight = np.clip(rho, c_min, cfg.mismatch_c_max) if cfg.mismatch_correction == "truncate" else inside * rho
    return weight, rho, ~inside, np.exp(token_log_rho) - token_log_rho - 1


def numpy_selection(entropy, mask, q):
    threshold = np.quantile(entropy[mask > 0], 1 - q)  # linear interpolation, as TRL's torch.quantile
    return ((entropy >= threshold) & (mask > 0)).astype(np.float64)


def numpy_expected(p, cfg: LossConfig, with_old: bool):
    """Loss, d hidden, d lm_head and metrics of token_mean GRPO with the corrections."""
    logp, entropy, probs = numpy_forward(p)
    mask, adv = np.float64(p.mask), np.float64(p.advantages)[:, None]
    old = np.float64(p.old) if with_old else logp
    ratio = np.exp(logp - old)
    clipped = np.clip(ratio, 1 - cfg.epsilon_low, 1 + cfg.epsilon_high)
    factor, metrics = np.ones_like(mask), {}
    if cfg.mismatch_correction != "none":
        weight, rho, rejected, kl = numpy_weights(cfg, old, np.float64(p.sampler), mask)
        factor *= weight
        m = mask > 0
        metrics.update(mismatch_kl=kl[m].mean(), mismatch_ratio_mean=rho[m].mean(), mismatch_ratio_max=rho[m].max(),
                       mismatch_rejected_frac=rejected[m].mean())
    if cfg.top_entropy_quantile < 1:
        selected = numpy_selection(entropy, mask, cfg.top_entropy_quantile)
        factor *= selected
        metrics["entropy_selected_frac"] = selected.sum() / mask.sum()
    loss = (-np.minimum(ratio * adv, clipped * adv) * factor * mask).sum() / mask.sum()
    unclipped = ratio * adv <= clipped * adv  # the branch min() takes; only it depends on logp
    d_logp = -adv * ratio * unclipped * factor * mask / mask.sum()
    onehot = np.eye(probs.shape[-1])[np.asarray(p.targets)]
    d_z = d_logp[..., None] * (onehot - probs) / TEMPERATURE  # [B, T, V]
    d_hidden = np.einsum("btv,hv->bth", d_z, np.float64(p.lm_head))
    d_lm_head = np.einsum("bth,btv->hv", np.float64(p.hidden), d_z)
    return {"loss": loss, "d_hidden": d_hidden, "d_lm_head": d_lm_head}, metrics


def implementation_result(impl, p, cfg: LossConfig, with_old: bool):
    old = p.old if with_old else None

    def loss(hidden, lm_head):
        out = grpo_loss(impl, hidden, lm_head, p.targets, p.mask, p.advantages, old, None, cfg,
                        temperature=TEMPERATURE, sampler_logp=p.sampler)
        return out.loss, out.metrics.summary()

    (value, metrics), grads = jax.jit(jax.value_and_grad(loss, (0, 1), has_aux=True))(p.hidden, p.lm_head)
    return {"loss": value, "d_hidden": grads[0], "d_lm_head": grads[1]}, metrics


@pytest.mark.parametrize("with_old", [True, False], ids=["old_logp", "single_update"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("impl", list(IMPLS))
def test_matches_numpy_formula(helpers, impl, case, with_old):
    p = problem(helpers)
    cfg = dataclasses.replace(BASE, **CASES[case])
    want, want_metrics = numpy_expected(p, cfg, with_old)
    got, got_metrics = implementation_result(IMPLS[impl], p, cfg, with_old)
    helpers.assert_tree_close(got, want, rtol=1e-5)
    for name, value in want_metrics.items():
        assert float(got_metrics[name]) == pytest.approx(value, rel=1e-5), name


@pytest.mark.parametrize("case", ["tis_token_cmin", "mis_token", "tis_sequence", "mis_sequence", "entropy_top30"])
def test_the_data_exercises_both_sides(helpers, case):
    """Some tokens are truncated/masked/dropped and some are not, so the tests above can fail."""
    p = problem(helpers)
    _, metrics = numpy_expected(p, dataclasses.replace(BASE, **CASES[case]), with_old=True)
    fraction = metrics.get("mismatch_rejected_frac", metrics.get("entropy_selected_frac"))
    assert 0.1 < fraction < 0.9


def test_without_mismatch_the_correction_changes_nothing(helpers):
    """Correction with thresholds no ratio reaches and q = 1 equal the plain loss exactly."""
    p = problem(helpers)
    plain, _ = implementation_result(IMPLS["jax"], p, BASE, True)
    wide = dataclasses.replace(BASE, mismatch_correction="mask", mismatch_c_min=1e-30, mismatch_c_max=1e30)
    assert float(implementation_result(IMPLS["jax"], p, wide, True)[0]["loss"]) != float(plain["loss"])  # rho != 1
    same_p = problem(helpers)
    same_p.sampler = same_p.old  # no mismatch: rho = 1 everywhere, weight 1
    corrected, metrics = implementation_result(IMPLS["jax"], same_p, wide, True)
    helpers.assert_tree_close(corrected, plain, rtol=0.0)
    assert float(metrics["mismatch_kl"]) == 0.0 and float(metrics["mismatch_rejected_frac"]) == 0.0


def test_missing_sampler_logps_is_an_error(helpers):
    p = problem(helpers)
    cfg = dataclasses.replace(BASE, mismatch_correction="truncate")
    with pytest.raises(ValueError, match="sampler_logp is None"):
        grpo_loss(IMPLS["jax"], p.hidden, p.lm_head, p.targets, p.mask, p.advantages, p.old, None, cfg)
