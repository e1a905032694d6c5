"""Rollout (legacy / maxtext) and training batch placement, and global batches from rows."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from grpo_core.config import MeshConfig
from grpo_meshes import (
    MeshError,
    build_mesh_from_config,
    global_batch,
    rollout_activation_rules,
    rollout_batch_axes,
    rollout_batch_sharding,
    rollout_batch_spec,
    train_batch_sharding,
    train_batch_spec,
)
from grpo_meshes.rules import rules_to_dict


@pytest.fixture(scope="module")
def mesh_222():
    return build_mesh_from_config(MeshConfig(strategy="2,2,2")).mesh


def rows_by_position(array, mesh):
    """{(dp, fsdp, tp): first-column values of the rows that device holds}."""
    position = {d: idx for idx, d in np.ndenumerate(mesh.devices)}
    return {position[s.device]: np.asarray(s.data)[:, 0].tolist() for s in array.addressable_shards}


def test_batch_specs():
    assert rollout_batch_spec("legacy") == P(("dp", "fsdp", "tp"), None)
    assert rollout_batch_spec("maxtext", ndim=3) == P(("dp",), None, None)
    assert train_batch_spec(ndim=1) == P(("dp", "fsdp"))
    with pytest.raises(MeshError, match=r"unknown rollout sharding style 'megatron'; use one of \['legacy', 'maxtext'\]"):
        rollout_batch_axes("megatron")


def test_legacy_rollout_gives_every_device_its_own_rows(mesh_222):
    tokens = global_batch(np.arange(16).reshape(8, 2), rollout_batch_sharding(mesh_222, "legacy"))
    placed = rows_by_position(tokens, mesh_222)
    for (dp, fsdp, tp), rows in placed.items():
        assert rows == [2 * (4 * dp + 2 * fsdp + tp)]  # row index dp*4 + fsdp*2 + tp, first column 2*row
    assert tokens.shape == (8, 2)


def test_maxtext_rollout_splits_over_dp_only(mesh_222):
    tokens = global_batch(np.arange(16).reshape(8, 2), rollout_batch_sharding(mesh_222, "maxtext"))
    placed = rows_by_position(tokens, mesh_222)
    for (dp, _, _), rows in placed.items():
        assert rows == [0, 2, 4, 6] if dp == 0 else [8, 10, 12, 14]  # replicated over fsdp and tp


def test_training_batch_splits_over_dp_and_fsdp(mesh_222):
    tokens = global_batch(np.arange(16).reshape(8, 2), train_batch_sharding(mesh_222))
    placed = rows_by_position(tokens, mesh_222)
    for (dp, fsdp, _), rows in placed.items():
        start = 2 * (2 * dp + fsdp)
        assert rows == [2 * start, 2 * start + 2]  # the same two rows on both tp devices


def test_global_batch_takes_pytrees_and_keeps_values(mesh_222):
    local = {"ids": np.arange(24).reshape(8, 3), "advantages": np.linspace(-1, 1, 8)}
    batch = global_batch(local, {"ids": train_batch_sharding(mesh_222), "advantages": train_batch_sharding(mesh_222, 1)})
    np.testing.assert_array_equal(np.asarray(batch["ids"]), local["ids"])
    assert float(jax.jit(jnp.sum)(batch["advantages"])) == pytest.approx(0.0, abs=1e-6)


def test_local_batch_not_divisible_names_numbers_and_nearest_sizes(mesh_222):
    with pytest.raises(MeshError, match=r"local batch of 12 rows on process 0 is not divisible by the 8 row "
                                        r"blocks .* dp\*fsdp\*tp .* nearest being 8 \(global 8\) or 16 \(global 16\)"):
        global_batch(np.zeros((12, 4)), rollout_batch_sharding(mesh_222, "legacy"))
    with pytest.raises(MeshError, match=r"not divisible by the 4 row blocks .* nearest being 4 \(global 4\) or 8"):
        global_batch(np.zeros((6,)), train_batch_sharding(mesh_222, 1))
    maxtext = global_batch(np.zeros((6, 1)), rollout_batch_sharding(mesh_222, "maxtext"))
    assert maxtext.shape == (6, 1)


def test_rollout_activation_rules_follow_the_style():
    legacy = rules_to_dict(rollout_activation_rules("legacy"))
    maxtext = rules_to_dict(rollout_activation_rules("maxtext"))
    assert legacy["batch"] == ("dp", "fsdp", "tp") and legacy["heads"] is None and legacy["vocab"] is None
    assert maxtext["batch"] == ("dp",) and maxtext["heads"] == "tp" and maxtext["kv_heads"] == "tp"
