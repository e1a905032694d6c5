"""The built-in advantage estimators against small examples worked by hand (see the module
doc of grpo_losses.estimators for the formulas)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from grpo_core.advantage_records import AdvantageSetup, StepRewards, kept_rows, zero_std_groups
from grpo_core.config import LossConfig
from grpo_core.registry import default_registry
from grpo_losses import compute_advantages
from grpo_losses.estimators import GdpoOptions, build_gdpo, build_grpo, build_reinforce_pp, build_rloo
from grpo_core.specs import NoOptions

# Four groups of 2: informative, all agree, informative, informative.
TOTAL = np.array([1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 0.5, 0.0], np.float32)
CENTRED = np.array([0.5, -0.5, 0.0, 0.0, -0.5, 0.5, 0.25, -0.25])
MASKED = np.array([1, 1, 0, 0, 1, 1, 1, 1], np.float32)  # dynamic sampling drops group 2


def setup(group_size=2, weights=None, **loss) -> AdvantageSetup:
    return AdvantageSetup(group_size, weights or {"correctness": 1.0}, **loss)


def rewards(total, keep=None, **per_fn) -> StepRewards:
    total = np.asarray(total, np.float32)
    return StepRewards(total, per_fn or {"correctness": total}, np.ones(total.size, np.float32) if keep is None else keep)


def test_the_zero_std_rule_and_the_kept_rows():
    np.testing.assert_array_equal(zero_std_groups(TOTAL, 2), [False, True, False, False])
    np.testing.assert_array_equal(kept_rows(TOTAL, 2, dynamic_sampling=True), MASKED)
    np.testing.assert_array_equal(kept_rows(TOTAL, 2, dynamic_sampling=False), np.ones(8))


@pytest.mark.parametrize("keep", [None, MASKED], ids=["all-rows", "masked"])
def test_rloo_subtracts_the_mean_of_the_other_rows(keep):
    out = build_rloo(NoOptions(), setup=setup())(rewards(TOTAL, keep))
    # groups of 2: the other row is the whole baseline, A_i = r_i - r_j
    np.testing.assert_array_equal(out.advantages, [1, -1, 0, 0, -1, 1, 0.5, -0.5])
    others = np.array([0, 1, 1, 1, 1, 0, 0, 0.5])
    kept = np.ones(8, bool) if keep is None else keep > 0
    assert out.metrics["train-other/adv_baseline_mean"] == pytest.approx(others[kept].mean(), rel=1e-12)
    assert out.metrics["train-other/adv_std"] == 1.0


def test_rloo_is_k_over_k_minus_1_times_the_centred_reward():
    total = np.array([1.0, 0.0, 0.0, 1.0, 1.0, 1.0], np.float32)  # one group of 3 agrees
    out = build_rloo(NoOptions(), setup=setup(3))(rewards(total))
    np.testing.assert_allclose(out.advantages, [1, -0.5, -0.5, 0, 0, 0], rtol=1e-6)  # 3/2 * (r - 1/3)


def test_reinforce_pp_baseline_divides_by_the_std_of_the_whole_step():
    est = build_reinforce_pp(NoOptions(), setup=setup(std_ddof=0, eps=0.0))
    out = est(rewards(TOTAL))
    # sum of squared centred rewards 1.125 over 8 rows: std 0.375
    np.testing.assert_allclose(out.advantages, CENTRED / 0.375, rtol=1e-6)
    assert out.metrics["train-other/adv_std"] == pytest.approx(0.375, rel=1e-12)
    assert out.metrics["train-other/adv_baseline_mean"] == pytest.approx(TOTAL.mean(), rel=1e-7)


def test_reinforce_pp_baseline_takes_its_std_over_the_kept_rows_only():
    out = build_reinforce_pp(NoOptions(), setup=setup(std_ddof=0, eps=0.0))(rewards(TOTAL, MASKED))
    std = math.sqrt(1.125 / 6)  # the masked group's two zeros leave the statistic
    np.testing.assert_allclose(out.advantages, CENTRED / std, rtol=1e-6)
    assert out.metrics["train-other/adv_std"] == pytest.approx(std, rel=1e-12)
    assert out.metrics["train-other/adv_baseline_mean"] == pytest.approx(1.25 / 3, rel=1e-12)  # kept group means


def test_reinforce_pp_baseline_with_ddof_and_eps():
    out = build_reinforce_pp(NoOptions(), setup=setup(std_ddof=1, eps=1e-4))(rewards(TOTAL))
    np.testing.assert_allclose(out.advantages, CENTRED / (math.sqrt(1.125 / 7) + 1e-4), rtol=1e-6)


def test_estimators_give_zero_when_every_group_agrees():
    total = np.array([1, 1, 0, 0], np.float32)
    for build in (build_rloo, build_reinforce_pp, build_grpo):
        out = build(NoOptions(), setup=setup(eps=0.0 if build is not build_grpo else 1e-4))(rewards(total))
        np.testing.assert_array_equal(out.advantages, np.zeros(4))
        assert all(math.isfinite(v) for v in out.metrics.values())


# ---- grpo ----------------------------------------------------------------------------------
@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_grpo_is_todays_advantage_bit_for_bit(scale):
    values = np.random.default_rng(0).uniform(size=12).astype(np.float32)
    cfg = LossConfig(scale_rewards=scale)
    est = build_grpo(NoOptions(), setup=setup(3, scale_rewards=scale, std_ddof=cfg.std_ddof, eps=cfg.advantage_eps))
    np.testing.assert_array_equal(est(rewards(values)).advantages, np.asarray(compute_advantages(values, 3, cfg).advantages))


def test_grpo_metrics_by_hand():
    out = build_grpo(NoOptions(), setup=setup(std_ddof=0))(rewards(TOTAL, MASKED))
    # kept groups: means 0.5, 0.5, 0.25 and (ddof 0) stds 0.5, 0.5, 0.25
    assert out.metrics["train-other/adv_baseline_mean"] == pytest.approx(1.25 / 3, rel=1e-12)
    assert out.metrics["train-other/adv_std"] == pytest.approx(1.25 / 3, rel=1e-12)
    np.testing.assert_allclose(out.advantages, CENTRED / (np.repeat([0.5, 0, 0.5, 0.25], 2) + 1e-4), rtol=1e-6)


# ---- gdpo ----------------------------------------------------------------------------------
WEIGHTS = {"correctness": 1.0, "format": 0.5}
CORRECT = np.array([1, 0, 1, 1, 1, 1], np.float32)
FORMAT = np.array([1, 1, 0, 1, 1, 1], np.float32)  # group 3 agrees on both (its total too)


def gdpo_rewards(keep=None) -> StepRewards:
    return rewards(CORRECT + 0.5 * FORMAT, keep, correctness=CORRECT, format=FORMAT)


def test_gdpo_normalises_each_reward_in_its_group_then_the_weighted_sum_over_the_step():
    out = build_gdpo(GdpoOptions(), setup=setup(weights=WEIGHTS, std_ddof=0, eps=0.0))(gdpo_rewards())
    # correctness in its groups: [1, -1], [0, 0], [0, 0]; format: [0, 0], [-1, 1], [0, 0]
    summed = np.array([1.0, -1.0, -0.5, 0.5, 0.0, 0.0])  # 1 * correctness + 0.5 * format
    std = math.sqrt(2.5 / 6)
    np.testing.assert_allclose(out.advantages, summed / std, rtol=1e-6)
    assert out.metrics["train-other/adv_std"] == pytest.approx(std, rel=1e-12)
    assert out.metrics["train-other/adv_baseline_mean"] == pytest.approx(0.0, abs=1e-15)
    assert out.metrics["train-other/adv_group_std/correctness"] == pytest.approx(1 / 6, rel=1e-12)  # 0.5 on 2 of 6
    assert out.metrics["train-other/adv_group_std/format"] == pytest.approx(1 / 6, rel=1e-12)


def test_gdpo_takes_its_step_statistics_over_the_kept_rows():
    keep = np.array([1, 1, 1, 1, 0, 0], np.float32)
    out = build_gdpo(GdpoOptions(), setup=setup(weights=WEIGHTS, std_ddof=0, eps=0.0))(gdpo_rewards(keep))
    np.testing.assert_allclose(out.advantages, np.array([1, -1, -0.5, 0.5, 0, 0]) / math.sqrt(2.5 / 4), rtol=1e-6)


def test_gdpo_differs_from_grpo_on_the_total():
    """GRPO on the total gives both informative groups the same spread; GDPO keeps correctness
    (weight 1) twice as strong as format (weight 0.5)."""
    grpo = build_grpo(NoOptions(), setup=setup(std_ddof=0, eps=0.0))(gdpo_rewards())
    np.testing.assert_allclose(grpo.advantages[:4], [1, -1, -1, 1], rtol=1e-6)
    gdpo = build_gdpo(GdpoOptions(batch_norm=False), setup=setup(weights=WEIGHTS, std_ddof=0, eps=0.0))(gdpo_rewards())
    np.testing.assert_allclose(gdpo.advantages, [1, -1, -0.5, 0.5, 0, 0], rtol=1e-6)


def test_gdpo_ignores_a_reward_of_weight_zero():
    weights = {**WEIGHTS, "judge": 0.0}
    judge = np.array([0, 1, 0, 1, 0, 1], np.float32)
    data = StepRewards(CORRECT + 0.5 * FORMAT, {"correctness": CORRECT, "format": FORMAT, "judge": judge}, np.ones(6))
    with_judge = build_gdpo(GdpoOptions(), setup=setup(weights=weights))(data)
    np.testing.assert_array_equal(with_judge.advantages, build_gdpo(GdpoOptions(), setup=setup(weights=WEIGHTS))(
        gdpo_rewards()).advantages)


# ---- combinations refused when the config loads --------------------------------------------
@pytest.mark.parametrize("build,message", [
    (build_rloo, "rollout.n = 1: rloo needs at least one other sample"),
    (build_reinforce_pp, "rollout.n = 1: reinforce_pp_baseline needs at least two samples"),
    (build_grpo, "rollout.n = 1 with loss.scale_rewards = 'group'"),
])
def test_groups_of_one_are_refused(build, message):
    with pytest.raises(ValueError, match=message):
        build(NoOptions(), setup=setup(1))


def test_gdpo_with_one_reward_function_is_refused_as_grpo():
    with pytest.raises(ValueError, match="with one reward function gdpo equals grpo"):
        build_gdpo(GdpoOptions(), setup=setup(weights={"correctness": 1.0, "format": 0.0}))


def test_every_estimator_is_registered_by_the_losses_package():
    registry = default_registry()
    assert registry.names("advantage") == ["gdpo", "grpo", "reinforce_pp_baseline", "rloo"]
    assert {item.distribution for item in registry.entries("advantage")} == {"grpo-losses"}
