"""Group-relative advantages: tunix / TRL conventions and dynamic sampling."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from grpo_core.config import LossConfig
from grpo_losses import compute_advantages, group_advantages, zero_std_groups


def tunix_rewards():
    """rewards = uniform(PRNGKey(0), (1, 6)) under the non-partitionable threefry."""
    previous = jax.config.jax_threefry_partitionable
    jax.config.update("jax_threefry_partitionable", False)
    try:
        return jax.random.uniform(jax.random.PRNGKey(0), (1, 6))
    finally:
        jax.config.update("jax_threefry_partitionable", previous)


def test_tunix_advantage_vector():
    # tunix divides by (std with ddof=1) + 1e-6
    advantages = group_advantages(tunix_rewards(), 3, std_ddof=1, eps=1e-6)
    expected = [0.307498, -1.117636, 0.810138, 1.094526, -0.228671, -0.865855]
    np.testing.assert_allclose(advantages, expected, atol=2e-6)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
@pytest.mark.parametrize("ddof", [0, 1])
def test_scaling_matches_numpy(scale, ddof):
    rewards = np.random.default_rng(0).uniform(size=12)
    groups = rewards.reshape(4, 3)
    centred = groups - groups.mean(1, keepdims=True)
    std = {"group": groups.std(1, ddof=ddof, keepdims=True), "batch": rewards.std(ddof=ddof), "none": None}[scale]
    expected = centred if std is None else centred / (std + 1e-4)
    got = group_advantages(rewards, 3, scale_rewards=scale, std_ddof=ddof, eps=1e-4)
    np.testing.assert_allclose(got, expected.reshape(-1), rtol=1e-5, atol=1e-6)


def test_zero_std_groups_and_dynamic_sampling():
    rewards = np.array([1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.5, 0.5, 0.5])
    np.testing.assert_array_equal(zero_std_groups(rewards, 3), [True, False, True])
    kept = compute_advantages(rewards, 3, LossConfig(dynamic_sampling=True))
    np.testing.assert_array_equal(kept.keep, [0, 0, 0, 1, 1, 1, 0, 0, 0])
    assert np.all(np.asarray(kept.advantages)[[0, 1, 2, 6, 7, 8]] == 0)  # no signal, and masked too
    np.testing.assert_array_equal(compute_advantages(rewards, 3, LossConfig()).keep, np.ones(9))


def test_config_values_are_used():
    rewards = np.random.default_rng(1).uniform(size=8)
    cfg = LossConfig(scale_rewards="batch", std_ddof=0, advantage_eps=0.5)
    np.testing.assert_allclose(compute_advantages(rewards, 4, cfg).advantages,
                               group_advantages(rewards, 4, scale_rewards="batch", std_ddof=0, eps=0.5))


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="do not split into groups of 4"):
        group_advantages(np.zeros(6), 4)
    with pytest.raises(ValueError, match="ddof=1 needs more than 1"):
        group_advantages(np.zeros(4), 1)
