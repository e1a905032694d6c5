"""`fused` and `pallas` agree with `jax` on the GRPO loss and its gradients
w.r.t. hidden and lm_head (float32, <= 1e-5 relative), over option combinations
(fused, with its one-pass gradient and with two passes: every pair of option
values; pallas, interpreted and slow on CPU: every value), with padding masks, an
odd vocab and T not a multiple of the blocks."""

from __future__ import annotations

import jax
import pytest
from grpo_losses import FusedLogps, FusedOptions, PallasLogps, PallasOptions, ReferenceLogps, grpo_loss

REFERENCE = ReferenceLogps()
TEMPERATURE = 0.8
reference_logp = jax.jit(lambda h, w, t: REFERENCE(h, w, t, TEMPERATURE).logp)


def loss_and_grads(impl, p, cfg, with_old: bool):
    old = p.base_logp + p.old_noise if with_old else None
    ref = p.base_logp + p.ref_noise

    def loss(hidden, lm_head):
        out = grpo_loss(impl, hidden, lm_head, p.targets, p.mask, p.advantages, old, ref, cfg,
                        temperature=TEMPERATURE)
        return out.loss, out

    (value, out), grads = jax.jit(jax.value_and_grad(loss, (0, 1), has_aux=True))(p.hidden, p.lm_head)
    return {"loss": value, "logp": out.logp, "d_hidden": grads[0], "d_lm_head": grads[1],
            "metrics": out.metrics.summary()}


def problem(helpers, seed: int):
    # 11 tokens per row against time blocks of 4/8, vocab 203 against blocks of 64/128,
    # right padding of different lengths
    p = helpers.make_problem(3, 11, 12, 203, seed=seed, lengths=[11, 6, 2])
    # old/ref near the policy's own log-probs so ratios straddle the clip range
    p.base_logp = reference_logp(p.hidden, p.lm_head, p.targets)
    return p


@pytest.mark.parametrize("one_pass", [True, False], ids=["one_pass", "two_pass"])
def test_fused_agrees_with_reference(helpers, pairwise_case, one_pass):
    p = problem(helpers, seed=10)
    cfg = helpers.config_of(pairwise_case)
    # one-pass token blocks of 4: 33 tokens, the last block overlaps its predecessor
    fused = FusedLogps(FusedOptions(block_size=64, time_block=4, one_pass=one_pass, one_pass_time_block=4))
    helpers.assert_tree_close(loss_and_grads(fused, p, cfg, pairwise_case["old_logp"]),
                              loss_and_grads(REFERENCE, p, cfg, pairwise_case["old_logp"]))


def test_pallas_agrees_with_reference(helpers, each_value_case):
    p = problem(helpers, seed=11)
    cfg = helpers.config_of(each_value_case)
    pallas = PallasLogps(PallasOptions(block_size=128, time_block=8))
    helpers.assert_tree_close(loss_and_grads(pallas, p, cfg, each_value_case["old_logp"]),
                              loss_and_grads(REFERENCE, p, cfg, each_value_case["old_logp"]))
