"""Tool-turn tokens of a multi-turn trajectory are inert in the loss: with loss mask 0 in the
middle of a row, the loss, its gradients and its metrics equal those of the same rows with
those tokens removed, whatever values their sampler, old and reference log-probs hold (no
gradient, no denominator, no entropy selection, no KL, no mismatch ratio)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from grpo_core.config import LossConfig
from grpo_losses import FusedLogps, FusedOptions, ReferenceLogps, grpo_loss

IMPLS = {"jax": ReferenceLogps(), "fused": FusedLogps(FusedOptions(block_size=64, time_block=4, one_pass_time_block=4))}
BASE = LossConfig(compute_entropy=True, epsilon_low=0.2, epsilon_high=0.28, beta=0.05, kl_estimator="k3")
CASES = {
    "tis_token": dict(mismatch_correction="truncate", mismatch_c_max=1.1),
    "mis_sequence": dict(mismatch_correction="mask", mismatch_level="sequence", mismatch_c_min=0.5,
                         mismatch_c_max=3.5),
    "entropy_and_mis": dict(top_entropy_quantile=0.5, mismatch_correction="mask", mismatch_c_max=1.25),
    "gspo_seq_mean": dict(importance_sampling_level="sequence", aggregation="seq_mean_token_mean",
                          mismatch_correction="truncate", mismatch_c_max=1.2),
}
# Per row: the columns of tool-turn tokens, and the row's real length (the rest is padding).
TOOL_COLUMNS = ([3, 4, 5, 6], [2, 3, 8, 9], [])
LENGTHS = (12, 11, 7)


def trajectory(seed: int = 3, batch: int = 3, time: int = 12, hidden: int = 16, vocab: int = 97) -> dict:
    rng = np.random.default_rng(seed)
    mask = (np.arange(time)[None] < np.array(LENGTHS)[:, None]).astype(np.float32)
    for row, columns in enumerate(TOOL_COLUMNS):
        mask[row, columns] = 0.0
    logp = -np.log(vocab) + 0.5 * rng.normal(size=(batch, time))
    old = logp + 0.3 * rng.normal(size=logp.shape)
    return dict(hidden=rng.normal(size=(batch, time, hidden)), lm_head=rng.normal(size=(hidden, vocab)) * 1.5 / 4,
                targets=rng.integers(0, vocab, size=(batch, time)), mask=mask, advantages=rng.normal(size=batch) + 0.3,
                old=old, ref=logp + 0.2 * rng.normal(size=logp.shape), sampler=old + 0.3 * rng.normal(size=logp.shape))


def with_tool_values(problem: dict, value: float) -> dict:
    """The problem with `value` in every log-prob input at the tool tokens (mask 0)."""
    tool = np.zeros_like(problem["mask"], bool)
    for row, columns in enumerate(TOOL_COLUMNS):
        tool[row, columns] = True
    return {**problem, **{name: np.where(tool, value, problem[name]) for name in ("old", "ref", "sampler")}}


def without_tool_tokens(problem: dict) -> tuple[dict, list]:
    """The rows with their tool-turn columns removed (shifted left, padded at the end), and
    each row's kept columns."""
    kept = [[t for t in range(problem["mask"].shape[1]) if t not in columns] for columns in TOOL_COLUMNS]
    compact = {}
    for name, value in problem.items():
        if name in ("lm_head", "advantages"):
            compact[name] = value
            continue
        out = np.zeros_like(value)
        for row, columns in enumerate(kept):
            out[row, :len(columns)] = value[row, columns]
        compact[name] = out
    return compact, kept


def loss_and_grads(impl, problem: dict, cfg: LossConfig):
    f32 = {name: jnp.asarray(value, jnp.int32 if name == "targets" else jnp.float32) for name, value in problem.items()}

    def loss(hidden, lm_head):
        out = grpo_loss(impl, hidden, lm_head, f32["targets"], f32["mask"], f32["advantages"], f32["old"], f32["ref"],
                        cfg, temperature=0.8, sampler_logp=f32["sampler"])
        return out.loss, out.metrics.summary()

    (value, metrics), grads = jax.jit(jax.value_and_grad(loss, (0, 1), has_aux=True))(f32["hidden"], f32["lm_head"])
    return float(value), np.asarray(grads[0]), np.asarray(grads[1]), jax.device_get(metrics)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("impl", list(IMPLS))
def test_tool_tokens_count_as_removed(impl, case):
    cfg = dataclasses.replace(BASE, **CASES[case])
    problem = trajectory()
    compact, kept = without_tool_tokens(problem)
    value, d_hidden, d_lm_head, metrics = loss_and_grads(IMPLS[impl], problem, cfg)
    want_value, want_hidden, want_lm_head, want_metrics = loss_and_grads(IMPLS[impl], compact, cfg)
    assert value == pytest.approx(want_value, rel=1e-5) and value != 0.0
    np.testing.assert_allclose(d_lm_head, want_lm_head, rtol=1e-4, atol=1e-7)
    for row, columns in enumerate(kept):
        np.testing.assert_allclose(d_hidden[row, columns], want_hidden[row, :len(columns)], rtol=1e-4, atol=1e-7)
        assert not np.any(d_hidden[row, TOOL_COLUMNS[row]])  # no gradient through a tool token
    for name, expected in want_metrics.items():
        assert float(metrics[name]) == pytest.approx(float(expected), rel=1e-4, abs=1e-7), name


@pytest.mark.parametrize("value", [0.0, 50.0, -1e4])
@pytest.mark.parametrize("case", list(CASES))
def test_tool_tokens_log_probs_change_nothing(case, value):
    """Whatever the rollout wrote there (the sampler writes 0), the result is the same and finite."""
    cfg = dataclasses.replace(BASE, **CASES[case])
    problem = trajectory()
    reference = loss_and_grads(IMPLS["jax"], with_tool_values(problem, -2.0), cfg)
    changed = loss_and_grads(IMPLS["jax"], with_tool_values(problem, value), cfg)
    assert np.isfinite(changed[0]) and changed[0] == reference[0]
    np.testing.assert_array_equal(changed[1], reference[1])
    np.testing.assert_array_equal(changed[2], reference[2])
