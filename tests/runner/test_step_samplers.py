"""The step-sampler contract (grpo_core.step_samplers): every built-in sampler keeps it, the
factory picks the one the config names, `loaded` always releases, and a sampler written
against grpo_core alone drives a real training step."""

import types

import jax
import numpy as np
import pytest

from grpo_core.contracts import CarryingSampler, Sampled, Scores, StepSampler, loaded
from grpo_core.registry import default_registry
from grpo_runner_gsm8k.samplers.factory import (MultiTurnPartialSampler, MultiTurnSampler, PartialSampler,
                                                PlainSampler, RefillSampler, step_sampler)


@pytest.mark.parametrize("sampler", [PlainSampler, RefillSampler, PartialSampler, MultiTurnSampler,
                                     MultiTurnPartialSampler])
def test_every_built_in_sampler_is_a_step_sampler_and_only_partial_ones_carry_rows(sampler):
    assert issubclass(sampler, StepSampler)
    assert issubclass(sampler, CarryingSampler) == (sampler in (PartialSampler, MultiTurnPartialSampler))


@pytest.mark.parametrize("overrides,expected", [
    ((), PlainSampler),
    (("loss.dynamic_sampling=true", "loss.dynamic_sampling_mode=refill"), RefillSampler),
    (("rollout.partial.enabled=true", "loss.mismatch_correction=truncate"), PartialSampler),
], ids=["plain", "refill", "partial"])
def test_the_factory_picks_the_sampler_the_config_names(tiny_config, overrides, expected):
    """(multi-turn runs are built by tests/runner/test_multi_turn_run.py, through the same factory)"""
    mesh = jax.make_mesh((1, jax.device_count(), 1), ("dp", "fsdp", "tp"))
    run = types.SimpleNamespace(cfg=tiny_config(*overrides), rollout=object(), mesh=mesh)
    assert type(step_sampler(run, default_registry())) is expected


def test_loaded_releases_the_weights_also_when_the_block_raises():
    calls = []
    backend = types.SimpleNamespace(load_weights=lambda policy: calls.append(("load", policy)),
                                    release_weights=lambda: calls.append("release"))
    with pytest.raises(RuntimeError, match="mid-rollout"):
        with loaded(backend, "the policy") as inside:
            assert inside is backend and calls == [("load", "the policy")]
            raise RuntimeError("mid-rollout")
    assert calls == [("load", "the policy"), "release"]


class RowIndexSampler:
    """A sampler as a third party would write it, on grpo_core alone: the run's first checked
    prompts rolled out as they are, row k of every group rewarded k (so every group is
    informative), one metric of its own and its rollout seconds fixed."""

    def __init__(self, run):
        self.run, self.calls = run, []

    def sample(self, policy, key, step):
        run, n = self.run, self.run.cfg.rollout.n
        prompts = list(run.inputs.prompt_ids.values())[:run.cfg.rollout.prompts_per_step]
        with loaded(run.rollout, policy) as backend:
            result = backend.generate(prompts, key, run.sampling, pad_token_id=run.inputs.tokenizer.pad_token_id,
                                      batch_sharding=run.rollout_sharding)
        self.calls.append((policy.graphdef, step))
        total = np.tile(np.arange(n, dtype=np.float32), len(prompts))
        scores = Scores(total, {"row_index": total}, {"row_index": 0})
        return Sampled([None] * len(prompts), result, scores), {"toy/groups": len(prompts)}, {"rollout_s": 0.25}


def test_a_third_party_sampler_drives_one_training_step(tiny_config, small_run):
    from grpo_runner_gsm8k.loop import Trainer
    from grpo_runner_gsm8k.assembly.run import build_run

    registry = default_registry()
    trainer = Trainer(build_run(tiny_config(*small_run(1), "rollout.max_new_tokens=2", registry=registry), registry))
    trainer.sampler = RowIndexSampler(trainer.built)
    assert isinstance(trainer.sampler, StepSampler) and not isinstance(trainer.sampler, CarryingSampler)
    metrics = trainer.step()
    assert trainer.sampler.calls == [(trainer.built.policy_graphdef, 0)] and trainer.state.step == 1
    assert metrics["toy/groups"] == 4  # the sampler's metrics are logged as it returns them
    assert "train-rollout/decode_steps" not in metrics  # the loop adds no sampling metric of its own
    assert metrics["time/train/rollout_s"] == 0.25 and metrics["time/train/reward_s"] >= 0.0
    # rows 0..3 of each group: mean 1.5 exactly in float32; no group is all-equal
    assert metrics["train-reward/total/mean"] == metrics["train-reward/func/row_index/mean"] == 1.5
    assert metrics["train-other/zero_std_frac"] == 0.0
    assert metrics["train-other/update_ratio"] > 0, "the step did not change the params"
