"""The loop's advantage step: the default estimator is the former GRPO advantage bit for bit,
and the kept rows come from the one zero-std rule that refill uses too."""

import numpy as np
import pytest

from grpo_core import NoOptions
from grpo_core.advantage_records import AdvantageSetup
from grpo_core.config import LossConfig
from grpo_core.registry import default_registry
from grpo_losses import compute_advantages
from grpo_runner_gsm8k.training.advantages import step_advantages
from grpo_runner_gsm8k.samplers.refill import informative
from grpo_runner_gsm8k.training.scoring import Scores


def scores(total) -> Scores:
    total = np.asarray(total, np.float32)
    return Scores(total, {"correctness": total}, {"correctness": 0})


@pytest.mark.parametrize("dynamic_sampling", [False, True])
@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_default_estimator_is_the_former_advantage(scale, dynamic_sampling):
    total = np.random.default_rng(3).integers(0, 2, size=24).astype(np.float32) * 0.7
    total[:4] = 0.7  # a group that agrees
    cfg = LossConfig(scale_rewards=scale, dynamic_sampling=dynamic_sampling)
    spec = default_registry().advantage(cfg.advantage_estimator)
    estimator = spec.factory(spec.options(), setup=AdvantageSetup(4, {"correctness": 1.0}, scale, cfg.std_ddof,
                                                                  cfg.advantage_eps))
    got = step_advantages(estimator, scores(total), 4, dynamic_sampling)
    former = compute_advantages(total, 4, cfg)
    np.testing.assert_array_equal(got.advantages, np.asarray(former.advantages))
    np.testing.assert_array_equal(got.keep, np.asarray(former.keep))
    assert got.metrics["train-other/zero_std_frac"] == float(np.mean(np.asarray(former.zero_std)))


def test_refill_and_the_kept_rows_agree_on_which_groups_are_informative():
    total = np.array([1, 1, 0, 1, 0.5, 0.5, 0, 0.25], np.float32)
    estimator = default_registry().advantage("rloo").factory(NoOptions(), setup=AdvantageSetup(2, {"correctness": 1.0}))
    kept = step_advantages(estimator, scores(total), 2, dynamic_sampling=True).keep
    np.testing.assert_array_equal(kept, np.repeat(informative(scores(total), 2), 2).astype(np.float32))
    np.testing.assert_array_equal(kept, [0, 0, 1, 1, 0, 0, 1, 1])


def test_an_estimator_returning_the_wrong_count_is_named():
    def short(rewards):
        from grpo_core.advantage_records import AdvantageResult
        return AdvantageResult(np.zeros(3, np.float32), {})

    with pytest.raises(ValueError, match="returned 3 advantages for 4 rows"):
        step_advantages(short, scores([1, 0, 1, 0]), 2, dynamic_sampling=False)
