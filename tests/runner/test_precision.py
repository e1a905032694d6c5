"""Mixed precision: float32 master weights keep updates that bfloat16 storage rounds away,
and bfloat16 compute on float32 masters matches an all-float32 update."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from grpo_core.config import LossConfig, TrainConfig
from grpo_core.models import QwenConfig, init_from_config
from grpo_core.models.precision import compute_params, update_ratio
from grpo_losses import FusedLogps, FusedOptions
from grpo_runner_gsm8k.assembly.optim import build_optimizer, learning_rate_schedule
from grpo_runner_gsm8k.training.step import UpdateBatch, make_update

ROWS, PROMPT, COMPLETION = 16, 4, 8
QCFG = QwenConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False)
LOSS = LossConfig(max_completion_length=COMPLETION)
FUSED = FusedLogps(FusedOptions(block_size=64, time_block=4))
TINY_LR = 1e-3  # configs/tiny.yaml


def random_batch(seed: int = 0) -> UpdateBatch:
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, QCFG.vocab_size, (ROWS, PROMPT + COMPLETION))
    lengths = rng.integers(1, COMPLETION + 1, ROWS)
    loss_mask = (np.arange(COMPLETION)[None] < lengths[:, None]).astype(np.float32)
    attention = np.concatenate([np.ones((ROWS, PROMPT)), loss_mask], axis=1)
    return UpdateBatch(input_ids=jnp.asarray(ids, jnp.int32), attention_mask=jnp.asarray(attention, jnp.int32),
                       targets=jnp.asarray(ids[:, PROMPT:], jnp.int32), loss_mask=jnp.asarray(loss_mask),
                       advantages=jnp.asarray(rng.normal(size=ROWS), jnp.float32), prompt_width=PROMPT)


def one_update(param_dtype: str, compute_dtype: str, lr: float, micro_batches: int = 2):
    """(params before, params after, metrics) of one adamw update from the same float32 init."""
    graphdef, params = nnx.split(init_from_config(QCFG, seed=0))
    params = compute_params(params, jnp.dtype(param_dtype))  # the float32 init, stored in param_dtype
    train = TrainConfig(lr=lr)
    optimizer = build_optimizer(train, learning_rate_schedule(train), param_dtype)
    update = make_update(graphdef, FUSED, LOSS, optimizer, 1.0, micro_batches, jnp.dtype(compute_dtype))
    before = jax.tree.map(np.asarray, params)
    after, opt_state, metrics = update(params, optimizer.init(params), random_batch())
    assert float(metrics["skipped"]) == 0.0
    assert {x.dtype for x in jax.tree.leaves(opt_state) if jnp.issubdtype(x.dtype, jnp.floating)} == {
        jnp.dtype(param_dtype)}  # moments keep their dtype across updates
    return before, jax.tree.map(np.asarray, after), metrics


def changed_fraction(before, after) -> list[float]:
    return [float(np.mean(a != b)) for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True)]


def test_bfloat16_compute_on_float32_masters_matches_float32_at_lr_1e_6():
    """Adam's first step is lr * g / (|g| + eps) ~ lr * sign(g) elementwise, so every weight
    whose gradient is not tiny moves by ~1e-6 in both runs. bfloat16 compute perturbs the
    gradient (relative ~1e-2), which can flip the sign only of near-zero components and
    changes |step| by < 1e-6 * (eps / |g|) elsewhere: the updates (after - before) agree to
    within 2 * lr per weight, and in norm to within 10% of the float32 update's norm."""
    lr = 1e-6
    before, mixed, mixed_metrics = one_update("float32", "bfloat16", lr)
    _, exact, exact_metrics = one_update("float32", "float32", lr)
    for b, m, e in zip(jax.tree.leaves(before), jax.tree.leaves(mixed), jax.tree.leaves(exact), strict=True):
        assert m.dtype == np.float32
        assert np.all(np.abs((m - b) - (e - b)) <= 2 * lr * (1 + 1e-3))
    assert min(changed_fraction(before, mixed)) > 0.5  # every tensor moves
    delta = lambda after: np.sqrt(sum(np.sum((a - b).astype(np.float64) ** 2)  # noqa: E731
                                      for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(before))))
    mixed_minus_exact = np.sqrt(sum(np.sum((m - e).astype(np.float64) ** 2)
                                    for m, e in zip(jax.tree.leaves(mixed), jax.tree.leaves(exact))))
    assert mixed_minus_exact <= 0.1 * delta(exact)
    assert float(mixed_metrics["update_ratio"]) == pytest.approx(float(exact_metrics["update_ratio"]), rel=0.1)
    print(f"\nlr 1e-6: ||mixed - f32|| / ||f32 update|| = {mixed_minus_exact / delta(exact):.4f}, "
          f"update_ratio mixed {float(mixed_metrics['update_ratio']):.3e} f32 {float(exact_metrics['update_ratio']):.3e}")


def test_float32_masters_move_every_tensor_where_bfloat16_storage_freezes():
    """At lr = tiny's / 100 = 1e-5 an Adam step (~1e-5) is below half the bfloat16 spacing of
    any weight above 2^-7 * 2 = 0.0039 in magnitude: normal(0.02) kernels and unit norm
    scales stay bitwise unchanged; update_ratio shows it."""
    lr = TINY_LR / 100
    before, masters, master_metrics = one_update("float32", "bfloat16", lr)
    before_bf16, pure, pure_metrics = one_update("bfloat16", "bfloat16", lr)
    master_changed, pure_changed = changed_fraction(before, masters), changed_fraction(before_bf16, pure)
    assert min(master_changed) > 0.5  # every tensor (biases start at 0: any step moves them)
    weights = sum(x.size for x in jax.tree.leaves(pure))
    unchanged = sum((1 - f) * x.size for f, x in zip(pure_changed, jax.tree.leaves(pure)))
    assert unchanged / weights > 0.75  # measured 0.846
    ratio_masters, ratio_pure = float(master_metrics["update_ratio"]), float(pure_metrics["update_ratio"])
    assert ratio_masters > 0 and ratio_pure < 0.75 * ratio_masters  # measured 0.49x
    print(f"\nlr {lr:g}: float32 masters change {min(master_changed):.3f}..{max(master_changed):.3f} of each tensor, "
          f"update_ratio {ratio_masters:.3e}; bfloat16 storage leaves {unchanged / weights:.3f} of the weights "
          f"unchanged, update_ratio {ratio_pure:.3e}")


def test_update_ratio_is_relative_norm_of_what_the_update_changes_in_storage():
    """bfloat16 spacing at 4.0 is 2^-5: +0.01 rounds away, +0.02 lands on 4.03125. Jitted
    too, where a compiler may fuse the rounding cast away as excess precision."""
    params = {"a": jnp.asarray([3.0, 0.0]), "b": jnp.asarray([[4.0]], jnp.bfloat16)}
    rounded_away = {"a": jnp.asarray([0.0, 0.5]), "b": jnp.asarray([[0.01]])}
    kept = {"a": jnp.asarray([0.0, 0.5]), "b": jnp.asarray([[0.02]])}
    for ratio in (update_ratio, jax.jit(update_ratio)):
        assert float(ratio(params, rounded_away)) == pytest.approx(0.5 / 5.0, rel=1e-6)
        assert float(ratio(params, kept)) == pytest.approx(np.hypot(0.5, 2.0 ** -5) / 5.0, rel=1e-6)
        assert float(ratio(params, jax.tree.map(jnp.zeros_like, kept))) == 0.0
