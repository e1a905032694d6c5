"""The GRPO math against formulas written independently in numpy (TRL / verl
style), over every combination of the `loss` options."""

from __future__ import annotations

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from grpo_core.config import LossConfig
from grpo_losses import FusedLogps, FusedOptions, aggregate, finalize_loss, grpo_loss, token_losses

FUSED = FusedLogps(FusedOptions(block_size=32, time_block=8))


def numpy_loss(logp, entropy, mask, adv, old, ref, cfg: LossConfig) -> float:
    """The reference formulas, float64, TRL GRPOTrainer-style."""
    logp, mask, adv = (np.asarray(x, np.float64) for x in (logp, mask, adv))
    old = logp if old is None else np.asarray(old, np.float64)
    log_ratio = logp - old
    if cfg.importance_sampling_level == "sequence":  # GSPO
        log_ratio = ((log_ratio * mask).sum(-1) / np.clip(mask.sum(-1), 1.0, None))[:, None]
    if cfg.logratio_clamp is not None:
        log_ratio = np.clip(log_ratio, -cfg.logratio_clamp, cfg.logratio_clamp)
    coef_1 = np.exp(log_ratio)
    coef_2 = np.clip(coef_1, 1 - cfg.epsilon_low, 1 + cfg.epsilon_high)
    per_token_loss = -np.minimum(coef_1 * adv[:, None], coef_2 * adv[:, None])
    if cfg.epsilon_c is not None:  # verl dual clip
        capped = np.minimum(-adv[:, None] * cfg.epsilon_c, per_token_loss)
        per_token_loss = np.where(adv[:, None] < 0, capped, per_token_loss)
    if cfg.beta > 0:
        d = np.asarray(ref, np.float64) - logp
        kl = {"k1": -d, "k2": 0.5 * d ** 2, "k3": np.exp(d) - d - 1}[cfg.kl_estimator]
        if cfg.kl_importance_weighted:  # TRL use_bias_correction_kl
            kl = kl * coef_1
        per_token_loss = per_token_loss + cfg.beta * kl
    if cfg.entropy_coef > 0:
        per_token_loss = per_token_loss - cfg.entropy_coef * np.asarray(entropy, np.float64)
    masked = per_token_loss * mask
    if cfg.aggregation == "seq_mean_token_mean":  # TRL "grpo"
        return float((masked.sum(-1) / np.clip(mask.sum(-1), 1.0, None)).mean())
    if cfg.aggregation == "token_mean":  # TRL "bnpo" / "dapo"
        return float(masked.sum() / np.clip(mask.sum(), 1.0, None))
    if cfg.aggregation == "seq_mean_token_sum":  # verl "seq-mean-token-sum"
        return float(masked.sum(-1).mean())
    return float(masked.sum() / (mask.shape[0] * cfg.max_completion_length))  # TRL "dr_grpo"


def math_inputs(seed: int = 0):
    rng = np.random.default_rng(seed)
    batch, time = 4, 6
    logp = rng.normal(size=(batch, time)) * 0.5 - 2.0
    mask = (np.arange(time)[None] < np.array([6, 3, 1, 5])[:, None]).astype(np.float32)
    return dict(logp=jnp.asarray(logp, jnp.float32),
                entropy=jnp.asarray(rng.uniform(0.5, 3.0, size=(batch, time)), jnp.float32),
                mask=jnp.asarray(mask), adv=jnp.asarray([0.9, -1.3, 0.4, -0.2], jnp.float32),
                old=jnp.asarray(logp + rng.normal(size=(batch, time)) * 0.3, jnp.float32),
                ref=jnp.asarray(logp + rng.normal(size=(batch, time)) * 0.4, jnp.float32))


def jax_loss(x, cfg, old):
    per_token, _ = token_losses(x["logp"], x["entropy"], x["mask"], x["adv"], old, x["ref"], cfg)
    return float(finalize_loss(*aggregate(per_token, x["mask"], cfg)))


def test_every_option_combination_matches_numpy(helpers):
    x = math_inputs()
    values = helpers.option_values
    failures = []
    for combo in itertools.product(*values.values()):
        case = dict(zip(values, combo))
        cfg = helpers.config_of(case)
        old = x["old"] if case["old_logp"] else None
        got = jax_loss(x, cfg, old)
        want = numpy_loss(x["logp"], x["entropy"], x["mask"], x["adv"], old, x["ref"], cfg)
        if abs(got - want) > 1e-5 * abs(want) + 1e-6:  # absolute part: terms of size ~|A| ~ 1 cancel
            failures.append((case, got, want))
    assert not failures, f"{len(failures)} combinations differ, first: {failures[0]}"


@pytest.mark.parametrize("aggregation,formula", [
    ("token_mean", lambda l, m, L: (l * m).sum() / m.sum()),
    ("seq_mean_token_mean", lambda l, m, L: ((l * m).sum(-1) / m.sum(-1)).mean()),
    ("seq_mean_token_sum", lambda l, m, L: (l * m).sum(-1).mean()),
    ("fixed_length_norm", lambda l, m, L: (l * m).sum() / (m.shape[0] * L)),
])
def test_trl_aggregation_formulas(aggregation, formula):
    """On-policy with per-token losses known in closed form: l = -A."""
    x = math_inputs(1)
    cfg = LossConfig(aggregation=aggregation, max_completion_length=10, compute_entropy=False)
    per_token = -np.repeat(np.asarray(x["adv"], np.float64)[:, None], 6, axis=1)
    expected = formula(per_token, np.asarray(x["mask"], np.float64), 10)
    assert abs(jax_loss(x, cfg, None) - expected) <= 1e-6 * abs(expected)


def test_on_policy_gradient_is_the_policy_gradient():
    x = math_inputs(2)
    cfg = LossConfig(compute_entropy=False)

    def numerator(logp):
        per_token, _ = token_losses(logp, None, x["mask"], x["adv"], None, None, cfg)
        return aggregate(per_token, x["mask"], cfg)[0]

    grad = jax.grad(numerator)(x["logp"])
    np.testing.assert_allclose(grad, -x["adv"][:, None] * x["mask"], rtol=1e-6)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_beta_really_adds_kl(helpers, estimator):
    p = helpers.make_problem(3, 5, 8, 70, seed=3, lengths=[5, 2, 4])
    ref = p.base_logp + p.ref_noise
    base = LossConfig(kl_estimator=estimator, compute_entropy=False)

    def loss(cfg):
        return jax.jit(lambda h, w: grpo_loss(FUSED, h, w, p.targets, p.mask, p.advantages, None, ref, cfg))(
            p.hidden, p.lm_head)

    without, with_kl = loss(base), loss(dataclasses.replace(base, beta=0.3))
    kl_mean = float(without.metrics.summary()["kl_mean"])
    assert kl_mean != 0.0
    assert float(with_kl.loss - without.loss) == pytest.approx(0.3 * kl_mean, rel=1e-5)


def trl_bias_corrected_loss(logp, old, ref, mask, adv, beta: float, sequence_level: bool):
    """TRL GRPOTrainer, loss_type "grpo" with use_bias_correction_kl, written out in jnp."""
    log_ratio = logp - old
    if sequence_level:
        log_ratio = ((log_ratio * mask).sum(-1) / jnp.clip(mask.sum(-1), 1.0))[:, None]
    coef_1 = jnp.exp(log_ratio)
    coef_2 = jnp.clip(coef_1, 0.8, 1.2)
    per_token_kl = (jnp.exp(ref - logp) - (ref - logp) - 1) * coef_1
    per_token_loss = -jnp.minimum(coef_1 * adv[:, None], coef_2 * adv[:, None]) + beta * per_token_kl
    return ((per_token_loss * mask).sum(-1) / jnp.clip(mask.sum(-1), 1.0)).mean()


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_importance_weighted_kl_is_trls_bias_corrected_kl(level):
    """Loss and d loss / d logp equal TRL's formula; the kl metric is the weighted term."""
    x = math_inputs(8)
    cfg = LossConfig(beta=0.3, kl_importance_weighted=True, importance_sampling_level=level,
                     aggregation="seq_mean_token_mean")

    def ours(logp):
        per_token, metrics = token_losses(logp, None, x["mask"], x["adv"], x["old"], x["ref"], cfg)
        return finalize_loss(*aggregate(per_token, x["mask"], cfg)), metrics

    (value, metrics), grad = jax.value_and_grad(ours, has_aux=True)(x["logp"])
    trl = lambda logp: trl_bias_corrected_loss(logp, x["old"], x["ref"], x["mask"], x["adv"], 0.3, level == "sequence")
    want, want_grad = jax.value_and_grad(trl)(x["logp"])
    # float32 sums of terms of size ~|A| ~ 1 that cancel to ~4e-3: an absolute part as above
    assert float(value) == pytest.approx(float(want), rel=1e-5, abs=1e-6)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-5, atol=1e-7)
    plain = dataclasses.replace(cfg, kl_importance_weighted=False)
    _, plain_metrics = token_losses(x["logp"], None, x["mask"], x["adv"], x["old"], x["ref"], plain)
    assert float(metrics.kl_sum) != pytest.approx(float(plain_metrics.kl_sum), rel=1e-3)  # the option acts


def test_entropy_bonus_subtracts_entropy(helpers):
    p = helpers.make_problem(2, 6, 8, 70, seed=4, lengths=[6, 3])

    def loss(coef):
        cfg = LossConfig(entropy_coef=coef)
        return jax.jit(lambda h, w: grpo_loss(FUSED, h, w, p.targets, p.mask, p.advantages, None, None, cfg))(
            p.hidden, p.lm_head)

    plain, bonus = loss(0.0), loss(0.05)
    entropy = float(plain.metrics.summary()["entropy_mean"])
    assert entropy > 0
    assert float(bonus.loss - plain.loss) == pytest.approx(-0.05 * entropy, rel=1e-5)


def test_metrics_match_numpy():
    x = math_inputs(5)
    cfg = LossConfig(epsilon_low=0.1, epsilon_high=0.15)
    _, metrics = token_losses(x["logp"], x["entropy"], x["mask"], x["adv"], x["old"], x["ref"], cfg)
    summary = metrics.summary()
    m = np.asarray(x["mask"]) > 0
    ratio = np.exp(np.asarray(x["logp"], np.float64) - np.asarray(x["old"], np.float64))
    adv = np.broadcast_to(np.asarray(x["adv"])[:, None], ratio.shape)
    d = np.asarray(x["ref"], np.float64) - np.asarray(x["logp"], np.float64)
    expected = {
        "clip_frac_low": ((ratio < 0.9) & (adv < 0))[m].mean(), "clip_frac_high": ((ratio > 1.15) & (adv > 0))[m].mean(),
        "ratio_mean": ratio[m].mean(), "ratio_min": ratio[m].min(), "ratio_max": ratio[m].max(),
        "kl_mean": (np.exp(d) - d - 1)[m].mean(), "entropy_mean": np.asarray(x["entropy"])[m].mean(),
    }
    assert 0 < expected["clip_frac_low"] + expected["clip_frac_high"]  # the data exercises clipping
    for name, value in expected.items():
        assert float(summary[name]) == pytest.approx(value, rel=1e-5), name


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum",
                                         "fixed_length_norm"])
def test_fully_masked_rows_count_nowhere(aggregation):
    x = math_inputs(6)
    cfg = LossConfig(aggregation=aggregation, max_completion_length=8, beta=0.1)
    padded = {k: jnp.concatenate([v, v[:1] * 0 + 7.0]) for k, v in x.items()}  # one extra row ...
    padded["mask"] = padded["mask"].at[-1].set(0.0)  # ... that is fully masked
    assert jax_loss(padded, cfg, padded["old"]) == pytest.approx(jax_loss(x, cfg, x["old"]), rel=1e-6)


def test_padding_with_extreme_values_stays_finite():
    x = math_inputs(7)
    padding = x["mask"] == 0
    old = jnp.where(padding, -1e30, x["old"])
    ref = jnp.where(padding, 1e30, x["ref"])
    cfg = LossConfig(beta=0.1, importance_sampling_level="sequence")

    def loss(logp):
        per_token, _ = token_losses(logp, None, x["mask"], x["adv"], old, ref, cfg)
        return finalize_loss(*aggregate(per_token, x["mask"], cfg))

    value, grad = jax.value_and_grad(loss)(x["logp"])
    assert np.isfinite(value) and np.all(np.isfinite(grad))
    assert np.all(np.asarray(grad)[np.asarray(padding)] == 0)


def test_config_errors_say_what_to_do(helpers):
    p = helpers.make_problem(1, 3, 4, 20)
    with pytest.raises(ValueError, match="ref_logp is None"):
        grpo_loss(FUSED, p.hidden, p.lm_head, p.targets, p.mask, p.advantages, None, None, LossConfig(beta=0.1))
    with pytest.raises(ValueError, match="max_completion_length"):
        grpo_loss(FUSED, p.hidden, p.lm_head, p.targets, p.mask, p.advantages, None, None,
                  LossConfig(aggregation="fixed_length_norm"))
