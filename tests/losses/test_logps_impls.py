"""The per-token log-prob implementations agree with the `jax` reference on
values and on gradients (for arbitrary cotangents of logp and entropy)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from grpo_losses import (
    FusedLogps,
    FusedOptions,
    PallasLogps,
    PallasOptions,
    ReferenceLogps,
    per_token_logps,
    validate_block_shape,
)
from grpo_losses.pallas_kernels import PallasKernels
from grpo_losses.vocab_parallel import blockwise_token_logps

REFERENCE = ReferenceLogps()

# (batch, time, hidden, vocab): T and V below, above and not multiples of the blocks.
SHAPES = {
    "smaller_than_blocks": (2, 5, 8, 37),
    "odd_vocab_ragged_time": (3, 11, 16, 333),
    "exact_multiples": (1, 16, 8, 256),
}


def value_and_grads(impl, p, entropy: bool, temperature: float = 0.7):
    """(logp, entropy) and d<cotangents . outputs>/d(hidden, lm_head)."""
    def objective(hidden, lm_head):
        out = impl(hidden, lm_head, p.targets, temperature, entropy=entropy)
        total = jnp.sum(out.logp * p.cotangents[0])
        if entropy:
            total = total + jnp.sum(out.entropy * p.cotangents[1])
        return total, out

    (_, out), grads = jax.jit(jax.value_and_grad(objective, (0, 1), has_aux=True))(p.hidden, p.lm_head)
    return out, grads


@pytest.mark.parametrize("shape", list(SHAPES.values()), ids=list(SHAPES))
@pytest.mark.parametrize("entropy", [False, True], ids=["logp", "logp+entropy"])
def test_fused_matches_reference(helpers, shape, entropy):
    p = helpers.make_problem(*shape, seed=1)
    fused = FusedLogps(FusedOptions(block_size=64, time_block=8))
    helpers.assert_tree_close(value_and_grads(fused, p, entropy), value_and_grads(REFERENCE, p, entropy))


@pytest.mark.parametrize("entropy", [False, True], ids=["logp", "logp+entropy"])
def test_pallas_matches_reference(helpers, entropy):
    p = helpers.make_problem(*SHAPES["odd_vocab_ragged_time"], seed=2)  # 3 vocab blocks, 5 token blocks, both ragged
    pallas = PallasLogps(PallasOptions(block_size=128, time_block=8))
    helpers.assert_tree_close(value_and_grads(pallas, p, entropy), value_and_grads(REFERENCE, p, entropy))


def test_pallas_single_block_smaller_than_tile(helpers):
    p = helpers.make_problem(*SHAPES["smaller_than_blocks"], seed=3)  # 10 tokens, 37 columns: one full-dim block
    pallas = PallasLogps(PallasOptions())
    helpers.assert_tree_close(value_and_grads(pallas, p, True), value_and_grads(REFERENCE, p, True))


def test_per_token_logps_same_through_every_impl(helpers):
    p = helpers.make_problem(2, 9, 8, 200, seed=4)
    def logps(impl):
        return jax.jit(lambda h, w, t: per_token_logps(impl, h, w, t, 1.3))(p.hidden, p.lm_head, p.targets)

    expected = logps(REFERENCE)
    for impl in (FusedLogps(FusedOptions(64, 4)), PallasLogps(PallasOptions(128, 8))):
        helpers.assert_tree_close(logps(impl), expected)


def test_logp_is_a_normalised_log_prob(helpers):
    """Scoring every vocab id of a token gives probabilities that sum to 1."""
    p = helpers.make_problem(1, 3, 4, 50, seed=5)
    hidden = jnp.repeat(p.hidden[0], 50, axis=0)[None]  # [1, 150, 4]: each of 3 tokens 50 times
    targets = jnp.tile(jnp.arange(50), 3)[None]  # [1, 150]: every id for each token
    logp = jax.jit(FusedLogps(FusedOptions(16, 8)))(hidden, p.lm_head, targets).logp.reshape(3, 50)
    assert jnp.allclose(jnp.sum(jnp.exp(logp), axis=1), 1.0, atol=1e-5)


def test_fused_never_allocates_logits():
    """Compiled temp memory of fused fwd+bwd stays far below one [B, T, V] buffer."""
    batch, time, hidden, vocab = 2, 512, 64, 32000
    logits_bytes = batch * time * vocab * 4
    args = (jax.ShapeDtypeStruct((batch, time, hidden), jnp.float32),
            jax.ShapeDtypeStruct((hidden, vocab), jnp.float32),
            jax.ShapeDtypeStruct((batch, time), jnp.int32))

    def temp_bytes(impl):
        def loss(h, w, t):
            out = impl(h, w, t, 1.0, entropy=True)
            return jnp.sum(out.logp) + jnp.sum(out.entropy)
        compiled = jax.jit(jax.value_and_grad(loss, (0, 1))).lower(*args).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    fused = temp_bytes(FusedLogps(FusedOptions(block_size=1024, time_block=256)))
    assert fused < logits_bytes / 8, f"fused temp {fused} bytes vs one logits buffer {logits_bytes}"
    assert temp_bytes(REFERENCE) >= logits_bytes  # the check can tell the difference


def test_pallas_kernels_lower_to_tpu_mosaic():
    """The kernels pass Pallas' TPU (Mosaic) lowering, in f32 and bf16."""
    kernels = PallasKernels(block_size=256, time_block=256, interpret=False)
    for dtype in (jnp.float32, jnp.bfloat16):
        def loss(h, w, t):
            out = blockwise_token_logps(kernels, h, w, t, 0.7, entropy=True)
            return jnp.sum(out.logp) + jnp.sum(out.entropy)
        args = (jax.ShapeDtypeStruct((2, 256, 256), dtype), jax.ShapeDtypeStruct((256, 1000), dtype),
                jax.ShapeDtypeStruct((2, 256), jnp.int32))
        text = jax.jit(jax.grad(loss, (0, 1))).trace(*args).lower(lowering_platforms=("tpu",)).as_text()
        assert text.count("tpu_custom_call") == 3  # stats, d_hidden, d_lm_head


def test_pallas_rejects_blocks_that_break_tpu_tiling(helpers):
    with pytest.raises(ValueError, match="multiple of 128"):
        PallasOptions(block_size=100)
    with pytest.raises(ValueError, match="multiple of 8"):
        PallasOptions(time_block=12)
    p = helpers.make_problem(1, 40, 8, 300, dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="multiple of 16"):  # bf16 tiles have 16 rows
        PallasLogps(PallasOptions(block_size=128, time_block=8))(p.hidden, p.lm_head, p.targets)
    with pytest.raises(ValueError, match="128"):
        validate_block_shape("w", (64, 200), (64, 1000), jnp.float32)
    validate_block_shape("w", (64, 1000), (64, 1000), jnp.float32)  # the full dim is always legal


def test_pallas_refuses_gpu_without_interpret(monkeypatch, helpers):
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    p = helpers.make_problem(1, 4, 8, 64)
    with pytest.raises(ValueError, match="use loss.impl: fused"):
        PallasLogps(PallasOptions())(p.hidden, p.lm_head, p.targets)


def test_fused_bfloat16_close_to_reference(helpers):
    p = helpers.make_problem(2, 7, 16, 300, seed=6, dtype=jnp.bfloat16)
    fused_out, fused_grads = value_and_grads(FusedLogps(FusedOptions(64, 4)), p, True)
    ref_out, ref_grads = value_and_grads(REFERENCE, p, True)
    assert fused_grads[0].dtype == jnp.bfloat16 and fused_grads[1].dtype == jnp.bfloat16
    assert helpers.max_rel_err(fused_out.logp, ref_out.logp) < 1e-5  # same bf16 inputs, f32 math
    assert helpers.max_rel_err(fused_grads[1].astype(jnp.float32), ref_grads[1].astype(jnp.float32)) < 2e-2
