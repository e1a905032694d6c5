"""LM head vocab sharded over `tp` on 8 fake CPU devices gives the unsharded
loss and gradients (the per-shard softmax states are combined exactly)."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from grpo_core.config import LossConfig
from grpo_losses import FusedLogps, FusedOptions, PallasLogps, PallasOptions, ReferenceLogps, grpo_loss
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

CFG = LossConfig(beta=0.05, entropy_coef=0.01, aggregation="seq_mean_token_mean")
VOCAB = 8 * 29  # 29 columns per device at tp=8: ragged against vocab blocks of 16


def mesh_of(shape, axis_types=None) -> Mesh:
    assert len(jax.devices()) == 8, "tests/conftest.py must give 8 fake CPU devices"
    devices = np.asarray(jax.devices()).reshape(shape)
    return Mesh(devices, ("dp", "fsdp", "tp"), axis_types=axis_types)


def loss_and_grads(impl, p, mesh=None):
    def loss(hidden, lm_head):
        return grpo_loss(impl, hidden, lm_head, p.targets, p.mask, p.advantages, p.base_logp + p.old_noise,
                         p.base_logp + p.ref_noise, CFG, temperature=0.9).loss

    step = jax.jit(jax.value_and_grad(loss, (0, 1)))
    if mesh is None:
        return step(p.hidden, p.lm_head)
    with jax.set_mesh(mesh):
        hidden = jax.device_put(p.hidden, NamedSharding(mesh, P("dp")))
        lm_head = jax.device_put(p.lm_head, NamedSharding(mesh, P(None, "tp")))
        return step(hidden, lm_head)


IMPLS = {"fused": FusedLogps(FusedOptions(block_size=16, time_block=8, one_pass_time_block=8)),
         "fused_two_pass": FusedLogps(FusedOptions(block_size=16, time_block=8, one_pass=False)),
         "pallas": PallasLogps(PallasOptions(block_size=128, time_block=8))}
MESHES = {"tp8": (1, 1, 8), "dp2_tp4": (2, 1, 4)}


@pytest.mark.parametrize("mesh_shape", list(MESHES.values()), ids=list(MESHES))
@pytest.mark.parametrize("impl_name", list(IMPLS))
def test_vocab_sharded_equals_unsharded(helpers, impl_name, mesh_shape):
    p = helpers.make_problem(4, 6, 8, VOCAB, seed=30, lengths=[6, 4, 1, 5])
    want = loss_and_grads(ReferenceLogps(), p)
    got = loss_and_grads(IMPLS[impl_name], p, mesh_of(mesh_shape))
    helpers.assert_tree_close(got, want)
    assert got[1][1].sharding.spec == P(None, "tp")  # d lm_head stays vocab-sharded


# token-level TIS (one-pass for fused), sequence-level MIS with entropy selection (two passes)
CORRECTED = {"tis_token": LossConfig(mismatch_correction="truncate", mismatch_c_max=1.1),
             "mis_sequence_entropy": LossConfig(mismatch_correction="mask", mismatch_level="sequence",
                                                   mismatch_c_max=2.0, top_entropy_quantile=0.5)}


@pytest.mark.parametrize("cfg_name", list(CORRECTED))
@pytest.mark.parametrize("impl_name", list(IMPLS))
def test_corrections_vocab_sharded_equal_unsharded(helpers, impl_name, cfg_name):
    p = helpers.make_problem(4, 6, 8, VOCAB, seed=32, lengths=[6, 4, 1, 5])
    cfg = CORRECTED[cfg_name]

    def loss(impl):
        return lambda h, w: grpo_loss(impl, h, w, p.targets, p.mask, p.advantages, p.base_logp + p.old_noise, None,
                                      cfg, temperature=0.9, sampler_logp=p.base_logp).loss

    want = jax.jit(jax.value_and_grad(loss(ReferenceLogps()), (0, 1)))(p.hidden, p.lm_head)
    mesh = mesh_of((2, 1, 4))
    with jax.set_mesh(mesh):
        hidden = jax.device_put(p.hidden, NamedSharding(mesh, P("dp")))
        lm_head = jax.device_put(p.lm_head, NamedSharding(mesh, P(None, "tp")))
        got = jax.jit(jax.value_and_grad(loss(IMPLS[impl_name]), (0, 1)))(hidden, lm_head)
    helpers.assert_tree_close(got, want)


def test_explicit_axis_mesh(helpers):
    p = helpers.make_problem(4, 6, 8, VOCAB, seed=31)
    mesh = mesh_of((2, 1, 4), axis_types=(AxisType.Explicit,) * 3)
    helpers.assert_tree_close(loss_and_grads(IMPLS["fused"], p, mesh), loss_and_grads(ReferenceLogps(), p))


def test_vocab_not_divisible_by_tp_is_a_clear_error(helpers):
    p = helpers.make_problem(2, 3, 8, VOCAB + 1)
    with pytest.raises(ValueError, match="not divisible by mesh axis 'tp' of size 8"), jax.set_mesh(mesh_of((1, 1, 8))):
        jax.jit(lambda h, w: IMPLS["fused"](h, w, p.targets).logp)(p.hidden, p.lm_head)
