"""Sum of numerators / sum of denominators over 4 micro-batches equals the loss
(and gradients, and metrics) of the one big batch, for every aggregation, with
advantages per row [B] and per token [B, T]."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from grpo_core.config import LossConfig
from grpo_losses import FusedLogps, FusedOptions, finalize_loss, grpo_loss, loss_denominator

FUSED = FusedLogps(FusedOptions(block_size=32, time_block=8))
MICRO_BATCHES = 4


def micro_step(cfg):
    """jit-ed (numerator, LossOutput), (d hidden, d lm_head) of one micro-batch."""
    def numerator(hidden, lm_head, targets, mask, advantages, old, ref):
        out = grpo_loss(FUSED, hidden, lm_head, targets, mask, advantages, old, ref, cfg)
        return out.numerator, out

    return jax.jit(jax.value_and_grad(numerator, (0, 1), has_aux=True))


def run(step, p, rows: slice):
    old, ref = p.base_logp + p.old_noise, p.base_logp + p.ref_noise
    return step(p.hidden[rows], p.lm_head, p.targets[rows], p.mask[rows], p.advantages[rows], old[rows], ref[rows])


def per_token_advantages(p) -> None:
    """Replace p's per-row advantages by per-token ones [B, T] that vary along each row."""
    p.advantages = jnp.asarray(np.random.default_rng(21).normal(size=p.mask.shape), jnp.float32)


@pytest.mark.parametrize("advantages", ["per_row", "per_token"])
@pytest.mark.parametrize("cfg", [
    LossConfig(aggregation="token_mean", beta=0.05, entropy_coef=0.01),
    LossConfig(aggregation="seq_mean_token_mean", importance_sampling_level="sequence"),
    LossConfig(aggregation="seq_mean_token_sum", beta=0.1, kl_estimator="k2"),
    LossConfig(aggregation="fixed_length_norm", max_completion_length=9, epsilon_c=3.0),
], ids=lambda cfg: cfg.aggregation)
def test_micro_batches_equal_the_big_batch(helpers, cfg, advantages):
    # lengths differ across micro-batches (one row fully masked) so per-micro-batch
    # means would weigh tokens differently from the big batch
    p = helpers.make_problem(8, 7, 8, 90, seed=20, lengths=[7, 1, 3, 0, 7, 7, 2, 5])
    if advantages == "per_token":
        per_token_advantages(p)
    step = micro_step(cfg)
    (big_num, big), (big_dh, big_dw) = run(step, p, slice(None))
    big_loss = finalize_loss(big_num, big.denominator)

    rows = 8 // MICRO_BATCHES
    parts = [run(step, p, slice(k * rows, (k + 1) * rows)) for k in range(MICRO_BATCHES)]
    total_den = sum(out.denominator for (_, out), _ in parts)
    assert float(total_den) == float(loss_denominator(p.mask, cfg))  # known up front from the mask
    loss = finalize_loss(sum(num for (num, _), _ in parts), total_den)
    d_hidden = jnp.concatenate([dh for _, (dh, _) in parts]) / total_den
    d_lm_head = sum(dw for _, (_, dw) in parts) / total_den

    helpers.assert_tree_close((loss, d_hidden, d_lm_head), (big_loss, big_dh / total_den, big_dw / total_den))
    metrics = parts[0][0][1].metrics
    for (_, out), _ in parts[1:]:
        metrics = metrics.merge(out.metrics)
    helpers.assert_tree_close(metrics.summary(), big.metrics.summary())


def test_per_micro_batch_means_would_differ(helpers):
    """The test above can fail: averaging per-micro-batch losses is not the big-batch loss."""
    p = helpers.make_problem(8, 7, 8, 90, seed=20, lengths=[7, 1, 3, 0, 7, 7, 2, 5])
    step = micro_step(LossConfig(aggregation="token_mean"))
    (_, big), _ = run(step, p, slice(None))
    means = [float(out.loss) for (_, out), _ in (run(step, p, slice(k * 2, k * 2 + 2)) for k in range(MICRO_BATCHES))]
    assert abs(np.mean(means) - float(big.loss)) > 1e-3
