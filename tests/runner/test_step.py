"""The jitted update: micro-batched accumulation equals one big batch, on one device
and FSDP-sharded over 8, and sharded micro-batches stay on their own devices."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from grpo_core.config import LossConfig, RunConfig
from grpo_core.models import QwenConfig, init_from_config
from grpo_core.sharding import freeze_rules, shard_model
from grpo_losses import FusedLogps, FusedOptions
from grpo_meshes import MeshStrategy, train_batch_sharding
from grpo_runner_gsm8k.assembly.build import build_model
from grpo_runner_gsm8k.training.step import (UpdateBatch, accumulates_in_backward, apply_finite_update, make_update,
                                    update_advantages)

ROWS, PROMPT, COMPLETION = 16, 4, 12
QCFG = QwenConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False)
LOSS = LossConfig(max_completion_length=COMPLETION)
FUSED = FusedLogps(FusedOptions(block_size=128, time_block=4))
FSDP8 = MeshStrategy("fsdp8", (1, 8, 1))


def model_parts(strategy: MeshStrategy | None, qcfg: QwenConfig = QCFG, remat: str = "none"):
    model = init_from_config(qcfg, seed=0, remat=remat)
    if strategy is not None:
        mesh = strategy.build_mesh()
        shard_model(model, mesh, strategy.param_rules)
        model.set_activation_sharding(mesh, strategy.activation_rules)
    return nnx.split(model)


def random_batch(seed: int = 0, rows: int = ROWS, prompt: int = PROMPT, completion: int = COMPLETION) -> UpdateBatch:
    rng = np.random.default_rng(seed)
    width = prompt + completion
    ids = rng.integers(0, QCFG.vocab_size, (rows, width))
    lengths = rng.integers(1, completion + 1, rows)
    loss_mask = (np.arange(completion)[None] < lengths[:, None]).astype(np.float32)
    attention = np.concatenate([np.ones((rows, prompt)), loss_mask], axis=1)
    return UpdateBatch(
        input_ids=jnp.asarray(ids, jnp.int32), attention_mask=jnp.asarray(attention, jnp.int32),
        targets=jnp.asarray(ids[:, prompt:], jnp.int32), loss_mask=jnp.asarray(loss_mask),
        advantages=jnp.asarray(rng.normal(size=rows), jnp.float32), prompt_width=prompt)


def place(batch: UpdateBatch, mesh) -> UpdateBatch:
    return jax.tree.map(lambda x: jax.device_put(x, train_batch_sharding(mesh, x.ndim)), batch)


def updated_params(strategy: MeshStrategy | None, micro_batches: int, remat: str = "none",
                   compute_dtype=None) -> dict:
    graphdef, params = model_parts(strategy, remat=remat)
    optimizer = optax.sgd(0.5)
    update = make_update(graphdef, FUSED, LOSS, optimizer, 1.0, micro_batches, compute_dtype)
    batch = random_batch() if strategy is None else place(random_batch(), params_mesh(params))
    new_params, _, metrics = update(params, optimizer.init(params), batch)
    assert float(metrics["skipped"]) == 0.0
    return jax.tree.map(np.asarray, nnx.to_pure_dict(new_params)), float(metrics["loss"])


def params_mesh(params):
    return jax.tree.leaves(params)[0].sharding.mesh


def assert_trees_close(actual, expected, rtol=2e-5, atol=1e-6):
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(a, e, rtol=rtol, atol=atol)


# f32 sums of 16 rows regrouped into micro-batches differ from the one-batch sums by a
# few ulps; after an SGD step with lr 0.5 that is ~1e-6 relative on the updated params.
@pytest.mark.parametrize("micro_batches", [2, 4])
def test_micro_batched_update_equals_one_batch(micro_batches):
    expected, expected_loss = updated_params(None, 1)
    actual, loss = updated_params(None, micro_batches)
    assert loss == pytest.approx(expected_loss, rel=1e-5)
    assert_trees_close(actual, expected)


def test_fsdp_sharded_micro_batched_update_equals_unsharded():
    expected, expected_loss = updated_params(None, 1)
    actual, loss = updated_params(FSDP8, 2)
    assert loss == pytest.approx(expected_loss, rel=1e-5)
    assert_trees_close(actual, expected)


@pytest.mark.parametrize("strategy, micro_batches", [(None, 2), (None, 4), (FSDP8, 2)], ids=["micro2", "micro4", "fsdp"])
def test_layer_gradients_summed_in_the_backward_loop_equal_jax_grad(strategy, micro_batches):
    """remat=full sums the layer gradients inside the backward layer loop
    (grpo_core.models.layer_grads); remat=none takes jax.grad of the scanned layers. Same
    float32 update up to summation order (the bound of the micro-batch test above; on one
    device the two are bitwise equal)."""
    assert accumulates_in_backward(*model_parts(None, remat="full"), micro_batches)
    assert not accumulates_in_backward(*model_parts(None, remat="full"), 1)
    assert not accumulates_in_backward(*model_parts(None, remat="none"), micro_batches)
    expected, expected_loss = updated_params(None, 1, remat="none")
    actual, loss = updated_params(strategy, micro_batches, remat="full")
    assert loss == pytest.approx(expected_loss, rel=1e-5)
    assert_trees_close(actual, expected)


def test_layer_gradients_summed_in_the_backward_loop_in_bfloat16_compute():
    """bfloat16 compute on float32 params: the same bfloat16 math, but rematerialised
    layers are fused differently by XLA (which keeps some fused bfloat16 intermediates in
    float32), so the two updates differ by bfloat16 rounding: measured 2.3e-4 of the update's
    norm; bound 2e-3 (a wrong or missing layer gradient is O(1))."""
    init = np.concatenate([np.ravel(x) for x in jax.tree.leaves(nnx.to_pure_dict(model_parts(None)[1]))])

    def update(remat: str) -> np.ndarray:
        params, _ = updated_params(None, 2, remat=remat, compute_dtype=jnp.bfloat16)
        return np.concatenate([np.ravel(x) for x in jax.tree.leaves(params)]) - init

    expected, actual = update("none"), update("full")
    assert np.linalg.norm(actual - expected) <= 2e-3 * np.linalg.norm(expected)


def compiled_temp_bytes(strategy: MeshStrategy | None, micro_batches: int) -> int:
    """Per-device temp of the update for 32 rows of 128 tokens (abstract inputs)."""
    qcfg = QwenConfig(vocab_size=256, hidden_size=64, intermediate_size=1024, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False)
    graphdef, params = model_parts(strategy, qcfg)
    optimizer = optax.sgd(0.5)
    update = make_update(graphdef, FUSED, LOSS, optimizer, 1.0, micro_batches)
    batch = random_batch(rows=32, prompt=8, completion=120)
    if strategy is not None:
        batch = place(batch, params_mesh(params))
    return update.lower(params, optimizer.init(params), batch).compile().memory_analysis().temp_size_in_bytes


def test_fsdp_micro_batches_are_computed_on_their_own_devices():
    """32 rows in 2 micro-batches of 16: each of 8 devices holds 4 rows, 2 per micro-batch.
    A micro-batch gathered onto every device (a contiguous split, or an unconstrained
    residual stream letting XLA all-reduce [B, T, mlp] activations) makes every device
    compute all 16 of its rows, so per-device temp matches the single-device run of the
    same micro-batches; sharded properly it is about 1/8 of that."""
    single_device = compiled_temp_bytes(None, 2)
    sharded = compiled_temp_bytes(FSDP8, 2)
    assert sharded < 0.5 * single_device, (sharded, single_device)


def test_runner_model_constrains_activations_with_the_activation_rules():
    """The param rules map no `batch`: a model built with them alone would leave the
    residual stream unconstrained (the failure the test above measures)."""
    model = build_model(RunConfig().model, QCFG, FSDP8.build_mesh(), FSDP8, "float32")
    _, rules = model.activation_sharding
    assert rules == freeze_rules(FSDP8.activation_rules)


def test_update_that_would_overflow_the_params_is_skipped():
    """Finite loss and gradient, but an update scaled by 1e30 twice overflows float32 (max 3.4e38)
    for every gradient entry above 3.4e-22: the update is refused and params returned unchanged."""
    graphdef, params = model_parts(None)
    before = jax.tree.map(np.array, nnx.to_pure_dict(params))
    optimizer = optax.chain(optax.scale(1e30), optax.scale(1e30))
    opt_state = optimizer.init(params)
    update = make_update(graphdef, FUSED, LOSS, optimizer, 1.0, 1)
    new_params, _, metrics = update(params, opt_state, random_batch())
    assert np.isfinite(float(metrics["loss"])) and np.isfinite(float(metrics["grad_norm"]))
    assert float(metrics["skipped"]) == 1.0
    for a, b in zip(jax.tree.leaves(nnx.to_pure_dict(new_params)), jax.tree.leaves(before), strict=True):
        np.testing.assert_array_equal(np.asarray(a), b)


@pytest.mark.parametrize("grads_stored", [True, False])
def test_finite_update_that_overflows_a_parameter_is_skipped(grads_stored):
    """SGD moves w = 3e38 by +1e38, a finite update whose sum overflows float32 (3.4e38);
    the same update to w = 1.0 is applied, with its relative size as update_ratio."""
    optimizer = optax.sgd(1e38)
    grads = {"w": jnp.asarray([-1.0])}
    for start, applied in ((3e38, False), (1.0, True)):
        params = {"w": jnp.asarray([start], jnp.float32)}
        new, _, ratio, ok = jax.jit(apply_finite_update, static_argnums=(0, 5))(
            optimizer, grads, optimizer.init(params), params, jnp.asarray(True), grads_stored)
        assert bool(ok) == applied
        expected = np.float32(start) + np.float32(1e38) if applied else np.float32(start)
        assert float(new["w"][0]) == float(expected)
        assert float(ratio) == (pytest.approx(1e38, rel=1e-6) if applied else 0.0)


def corrected_update(loss_cfg: LossConfig, micro_batches: int, with_sampler: bool = True):
    graphdef, params = model_parts(None)
    optimizer = optax.sgd(0.5)
    update = make_update(graphdef, FUSED, loss_cfg, optimizer, 1.0, micro_batches)
    batch = random_batch()
    if with_sampler:  # near the random-init model's own log-probs (about -log V) so ratios straddle 1
        noise = np.random.default_rng(9).normal(size=batch.targets.shape) * 0.3
        batch = batch.replace(sampler_logp=jnp.asarray(-np.log(QCFG.vocab_size) + noise, jnp.float32))
    new_params, _, metrics = update(params, optimizer.init(params), batch)
    return jax.tree.map(np.asarray, nnx.to_pure_dict(new_params)), jax.device_get(metrics)


@pytest.mark.parametrize("options", [
    dict(mismatch_correction="truncate", mismatch_c_max=1.1),
    dict(mismatch_correction="mask", mismatch_level="sequence", mismatch_c_min=0.2, mismatch_c_max=5.0),
], ids=["tis_token", "mis_sequence"])
def test_corrected_update_carries_sampler_logps_and_accumulates_exactly(options):
    """Weights are per token or per whole sequence, and micro-batches split whole sequences,
    so the micro-batched corrected update equals the one-batch one; and it is not the plain one."""
    cfg = LossConfig(max_completion_length=COMPLETION, **options)
    expected, metrics = corrected_update(cfg, 1)
    actual, micro_metrics = corrected_update(cfg, 4)
    assert_trees_close(actual, expected)
    assert 0.0 < float(metrics["mismatch_rejected_frac"]) < 1.0
    for name in ("mismatch_kl", "mismatch_ratio_mean", "mismatch_ratio_max", "mismatch_rejected_frac"):
        assert float(micro_metrics[name]) == pytest.approx(float(metrics[name]), rel=1e-5), name
    plain, _ = corrected_update(LOSS, 1, with_sampler=False)
    assert max(float(np.max(np.abs(a - b))) for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(expected))) > 0


def token_advantage_update(strategy: MeshStrategy | None, micro_batches: int, per_token) -> dict:
    """Params after one update whose advantages are `per_token(batch)` [N, C]."""
    graphdef, params = model_parts(strategy)
    optimizer = optax.sgd(0.5)
    update = make_update(graphdef, FUSED, LOSS, optimizer, 1.0, micro_batches)
    batch = random_batch()
    batch = batch.replace(advantages=per_token(batch))
    if strategy is not None:
        batch = place(batch, params_mesh(params))  # [N, C] advantages sharded like the loss mask
        assert batch.advantages.sharding == batch.loss_mask.sharding
    new_params, _, metrics = update(params, optimizer.init(params), batch)
    assert float(metrics["skipped"]) == 0.0
    return jax.tree.map(np.asarray, nnx.to_pure_dict(new_params))


def varying_advantages(batch: UpdateBatch) -> jax.Array:
    return jnp.asarray(np.random.default_rng(4).normal(size=batch.loss_mask.shape), jnp.float32)


def test_token_advantages_travel_through_the_sharded_micro_batched_update():
    """[N, C] advantages constant along each row update the params as the per-row ones do;
    varying along the rows, FSDP-sharded in micro-batches they equal one unsharded batch
    (the bound of the micro-batch tests above), and differ from the per-row update."""
    per_row, _ = updated_params(None, 1)
    constant = token_advantage_update(FSDP8, 2, lambda b: jnp.broadcast_to(b.advantages[:, None], b.loss_mask.shape))
    assert_trees_close(constant, per_row)
    varying = token_advantage_update(None, 1, varying_advantages)
    assert_trees_close(token_advantage_update(FSDP8, 2, varying_advantages), varying)
    assert max(float(np.max(np.abs(a - b))) for a, b in zip(jax.tree.leaves(varying), jax.tree.leaves(per_row))) > 1e-4


def test_update_advantages_keep_the_trained_completion_columns():
    rollout = np.arange(12, dtype=np.float32).reshape(2, 6)  # [N, max_new_tokens]
    np.testing.assert_array_equal(update_advantages(rollout, 4), rollout[:, :4])
    np.testing.assert_array_equal(update_advantages(np.asarray([1.0, -1.0]), 4), [1.0, -1.0])
    with pytest.raises(ValueError, match=r"advantages have shape \(2, 3\).*W >= the 4 trained completion columns"):
        update_advantages(rollout[:, :3], 4)
