"""A mixture-of-experts policy's update: router/* metrics equal grpo_core's router statistics,
and `loss.router_balance_coef` adds exactly coef * the balance loss's gradient, on the plain
jax.grad path and the accumulating backward (scanned layers, full remat, micro-batches)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from grpo_core.config import LossConfig
from grpo_core.errors import ConfigError
from grpo_core.models import QwenConfig, init_from_config
from grpo_core.models.router_stats import router_statistics
from grpo_losses import FusedLogps, FusedOptions, finalize_loss, grpo_loss
from grpo_runner_gsm8k.cli import main
from grpo_runner_gsm8k.training.router_term import router_coef
from grpo_runner_gsm8k.training.step import UpdateBatch, accumulates_in_backward, completion_hidden, make_update

MOE = QwenConfig.tiny("qwen3_moe", vocab_size=256)
ROWS, PROMPT, COMPLETION = 8, 4, 12
LOSS = LossConfig(max_completion_length=COMPLETION)
FUSED = FusedLogps(FusedOptions(block_size=128, time_block=4))
COEF, LR = 0.5, 1.0
# f32 on CPU: the update and the reference sum the same terms in another order (micro-batches,
# the scanned backward); gradient entries are O(1e-2), their differences ~1e-8.
ATOL, RTOL = 2e-6, 2e-5


def random_batch() -> UpdateBatch:
    """Rows of random tokens with completions of random lengths (padding masked)."""
    rng = np.random.default_rng(0)
    ids = rng.integers(0, MOE.vocab_size, (ROWS, PROMPT + COMPLETION))
    loss_mask = (np.arange(COMPLETION)[None] < rng.integers(1, COMPLETION + 1, ROWS)[:, None]).astype(np.float32)
    attention = np.concatenate([np.ones((ROWS, PROMPT)), loss_mask], axis=1)
    return UpdateBatch(input_ids=jnp.asarray(ids, jnp.int32), attention_mask=jnp.asarray(attention, jnp.int32),
                       targets=jnp.asarray(ids[:, PROMPT:], jnp.int32), loss_mask=jnp.asarray(loss_mask),
                       advantages=jnp.asarray(rng.normal(size=ROWS), jnp.float32), prompt_width=PROMPT)


def moe_update(router, micro_batches: int = 1, remat: str = "none"):
    graphdef, params = nnx.split(init_from_config(MOE, seed=0, remat=remat))
    update = make_update(graphdef, FUSED, LOSS, optax.sgd(LR), 1.0, micro_batches, router_coef=router)
    donated = jax.tree.map(jnp.copy, params)  # the update donates its params
    new_params, _, metrics = update(donated, optax.sgd(LR).init(donated), random_batch())
    return graphdef, params, new_params, metrics


def assert_router_metrics(graphdef, params, metrics):
    """router/* equal grpo_core's router statistics of the params before the update."""
    batch = random_batch()
    stats = router_statistics(nnx.merge(graphdef, params), batch.input_ids, batch.attention_mask)
    assert float(metrics["router/balance_loss"]) == pytest.approx(float(stats.balance_loss), rel=1e-6)
    assert float(metrics["router/max_load"]) == pytest.approx(float(jnp.max(stats.load)), rel=1e-6)
    assert float(metrics["router/min_load"]) == pytest.approx(float(jnp.min(stats.load)), rel=1e-6)
    assert float(metrics["router/dropped"]) == 0.0
    per_expert = [float(metrics[f"router/load/expert_{e}"]) for e in range(MOE.num_experts)]
    assert per_expert == pytest.approx(np.mean(np.asarray(stats.load), axis=0).tolist(), rel=1e-6)
    assert float(metrics["router/max_load"]) > 1.0 / MOE.num_experts > float(metrics["router/min_load"])


def test_dense_update_has_no_router_metrics():
    graphdef, params = nnx.split(init_from_config(QwenConfig.tiny("qwen3", vocab_size=256), seed=0))
    _, _, metrics = make_update(graphdef, FUSED, LOSS, optax.sgd(LR), 1.0, 1)(params, optax.sgd(LR).init(params),
                                                                              random_batch())
    assert not [name for name in metrics if name.startswith("router/")]


def reference_gradient(graphdef, params, coef: float):
    """jax.grad of (policy loss + coef * balance loss) over the whole batch."""
    batch = random_batch()

    def objective(p):
        hidden, head = completion_hidden(graphdef, p, batch.input_ids, batch.attention_mask, PROMPT)
        out = grpo_loss(FUSED, hidden, head, batch.targets, batch.loss_mask, batch.advantages, None, None, LOSS)
        balance = router_statistics(nnx.merge(graphdef, p), batch.input_ids, batch.attention_mask).balance_loss
        return finalize_loss(out.numerator, out.denominator) + coef * balance

    return jax.grad(objective)(params)


@pytest.mark.parametrize("coef,micro_batches,remat", [(0.0, 1, "none"), (COEF, 1, "none"), (COEF, 2, "full")])
def test_update_gradient_is_policy_plus_coef_balance(coef, micro_batches, remat):
    graphdef, params, new_params, metrics = moe_update(coef, micro_batches, remat)
    assert accumulates_in_backward(graphdef, params, micro_batches) == (micro_batches > 1)
    assert float(metrics["skipped"]) == 0.0
    assert_router_metrics(graphdef, params, metrics)
    step = jax.tree.map(lambda old, new: (old - new) / LR, params, new_params)  # sgd: the gradient
    expected = reference_gradient(graphdef, params, coef)
    for got, want in zip(jax.tree.leaves(step), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)
    if coef:  # the balance term moves the gradient well beyond the tolerance
        plain = reference_gradient(graphdef, params, 0.0)
        moved = max(float(np.abs(a - b).max()) for a, b in zip(jax.tree.leaves(step), jax.tree.leaves(plain)))
        assert moved > 100 * ATOL


def test_balance_coefficient_refused_for_a_dense_model():
    dense, moe = QwenConfig.tiny("qwen3"), QwenConfig.tiny("qwen3_moe")
    assert router_coef(LossConfig(), dense) is None
    assert router_coef(LossConfig(router_balance_coef=0.01), moe) == 0.01
    with pytest.raises(ConfigError, match=r"loss.router_balance_coef = 0.01 .* model_type qwen3 has no router"):
        router_coef(LossConfig(router_balance_coef=0.01), dense)


def test_grpo_run_refuses_the_coefficient_for_a_dense_model_at_config_load(tiny_config_path, capsys):
    assert main(["--config", tiny_config_path, "--print-config", "loss.router_balance_coef=0.01"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model_type qwen2 has no router" in err[0], err
