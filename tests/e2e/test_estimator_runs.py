"""Each advantage estimator through the real loop of the tiny config, with dynamic sampling
(mask and refill), partial rollouts and LoRA: the estimator receives the step's whole batch
with every reward function's rewards and the kept rows, and what it returns is what the
step logs and trains on."""

import json
import math
from pathlib import Path

import numpy as np
import pytest

from grpo_core import AdvantageSpec, hookimpl
from grpo_core.advantage_records import kept_rows
from grpo_core.registry import default_registry
from grpo_core.testing import registry_with

TWO_REWARDS = ["task.rewards={correctness: 1.0, format: 0.5}", "task.reward_options={format: {style: number_only}}"]
RUNS = {
    "rloo_mask": ("rloo", ["loss.dynamic_sampling=true"]),
    "reinforce_pp_baseline_refill": ("reinforce_pp_baseline", ["loss.dynamic_sampling=true",
                                                               "loss.dynamic_sampling_mode=refill",
                                                               "loss.max_extra_rollouts=2"]),
    "gdpo_lora": ("gdpo", [*TWO_REWARDS, "model.lora.rank=4", "model.lora.alpha=8"]),
    "gdpo_partial_mask": ("gdpo", [*TWO_REWARDS, "rollout.max_new_tokens=4", "rollout.partial.enabled=true",
                                   "rollout.partial.budget=2", "loss.mismatch_correction=truncate",
                                   "loss.dynamic_sampling=true"]),
}


class Spy:
    """A plugin wrapping the built-in estimator `name` as `spy`, recording each call."""

    def __init__(self, name: str):
        self.inner, self.calls = default_registry().advantage(name), []

    @hookimpl
    def grpo_advantages(self):
        def build(options, *, setup):
            estimator = self.inner.factory(options, setup=setup)

            def recorded(rewards):
                out = estimator(rewards)
                self.calls.append((rewards, out))
                return out
            return recorded
        return [AdvantageSpec("spy", build, self.inner.options, "records what it computes")]


@pytest.mark.parametrize("run", list(RUNS))
def test_estimator_trains_on_the_whole_step_batch(run, tiny_config, small_run):
    from grpo_runner_gsm8k.loop import Trainer, build_run

    name, overrides = RUNS[run]
    spy = Spy(name)
    registry = registry_with(spy)
    cfg = tiny_config(*small_run(2), *overrides, "loss.advantage_estimator=spy", registry=registry)
    Trainer(build_run(cfg, registry)).run()
    records = [json.loads(line) for line in (Path(cfg.logging.dir) / "metrics.jsonl").read_text().splitlines()]
    assert len(spy.calls) == len(records) == 2
    for (rewards, out), record in zip(spy.calls, records):
        assert np.asarray(rewards.total).shape == (16,)  # prompts_per_step x n, whatever was refilled or carried
        assert list(rewards.per_fn) == list(cfg.task.rewards)
        weighted = sum(cfg.task.rewards[fn] * np.asarray(values) for fn, values in rewards.per_fn.items())
        np.testing.assert_allclose(rewards.total, weighted, rtol=1e-6)
        np.testing.assert_array_equal(rewards.keep, kept_rows(rewards.total, 4, cfg.loss.dynamic_sampling))
        assert out.metrics and all(record[key] == value for key, value in out.metrics.items())
        assert math.isfinite(record["train-other/loss"]) and math.isfinite(record["train-other/adv_std"])
