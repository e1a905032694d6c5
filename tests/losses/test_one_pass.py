"""The `fused` one-pass gradient: three LM-head matmuls per update instead of
four, only for token-level ratios, within the loss's memory budget. (Agreement
with `jax` on values and gradients: test_impl_agreement.py, test_sharding.py.)"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from grpo_core.config import LossConfig
from grpo_losses import FusedLogps, FusedOptions, grpo_loss

VOCAB = 203


def specs(batch: int, time: int, hidden: int, vocab: int) -> tuple[jax.ShapeDtypeStruct, ...]:
    f32 = jnp.float32
    return (jax.ShapeDtypeStruct((batch, time, hidden), f32), jax.ShapeDtypeStruct((hidden, vocab), f32),
            jax.ShapeDtypeStruct((batch, time), jnp.int32), jax.ShapeDtypeStruct((batch, time), f32),
            jax.ShapeDtypeStruct((batch,), f32), jax.ShapeDtypeStruct((batch, time), f32))


def compiled_update(impl, cfg: LossConfig, shapes):
    def loss(hidden, lm_head, targets, mask, advantages, old_logp):
        return grpo_loss(impl, hidden, lm_head, targets, mask, advantages, old_logp, None, cfg).loss

    return jax.jit(jax.value_and_grad(loss, (0, 1))).lower(*shapes)


def lm_head_matmuls(impl, cfg: LossConfig) -> int:
    """dot_general ops in the loss's value and gradient: every one multiplies by (a
    block of) the LM head, and each sits once in its loop body, whatever the trip count."""
    text = compiled_update(impl, cfg, specs(2, 5, 8, VOCAB)).as_text()
    return text.count("stablehlo.dot_general")


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum",
                                         "fixed_length_norm"])
def test_token_level_ratios_take_three_lm_head_matmuls(aggregation):
    cfg = LossConfig(aggregation=aggregation, max_completion_length=5, entropy_coef=0.01)
    assert lm_head_matmuls(FusedLogps(FusedOptions(block_size=64)), cfg) == 3  # logits, d hidden, d lm_head
    assert lm_head_matmuls(FusedLogps(FusedOptions(block_size=64, one_pass=False)), cfg) == 4


@pytest.mark.parametrize("policy_loss", ["cispo", "sapo"])
def test_cispo_and_sapo_take_the_one_pass(policy_loss):
    """Their per-token losses depend on the token's own logp: elementwise, like clip's."""
    assert lm_head_matmuls(FusedLogps(FusedOptions(block_size=64)), LossConfig(policy_loss=policy_loss)) == 3


def test_sequence_level_ratios_keep_two_passes():
    cfg = LossConfig(importance_sampling_level="sequence")
    assert lm_head_matmuls(FusedLogps(FusedOptions(block_size=64)), cfg) == 4


def test_one_pass_temp_memory_within_budget():
    """B=8, T=2048, V=151936, H=2048 float32: compiled temp <= 256 MiB (XLA:CPU figure)."""
    compiled = compiled_update(FusedLogps(), LossConfig(), specs(8, 2048, 2048, 151936)).compile()
    assert compiled.memory_analysis().temp_size_in_bytes <= 256 * 2 ** 20


def test_one_pass_option_is_checked():
    with pytest.raises(ValueError, match="one_pass must be true or false"):
        FusedOptions(one_pass="yes")
    with pytest.raises(ValueError, match="one_pass_time_block must be a positive int"):
        FusedOptions(one_pass_time_block=0)
