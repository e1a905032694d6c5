"""The objective options on the tiny config through the real loop: mismatch correction,
overlong handling, high-entropy token selection, dynamic-sampling refill and the cispo and
sapo policy losses train without NaN and log their metrics (metrics.jsonl and W&B); bad
values exit 2 with one line; a refilling run resumed from a checkpoint ends bitwise equal
to an uninterrupted one."""

import json
import math
from pathlib import Path
from typing import Callable

import jax
import numpy as np
import pytest
from flax import nnx

from grpo_core.registry import default_registry
from grpo_runner_gsm8k.cli import main
from grpo_runner_gsm8k.commands.export import load_policy

MISMATCH = ["train-other/mismatch_kl", "train-other/mismatch_ratio_mean", "train-other/mismatch_ratio_max",
            "train-other/mismatch_rejected_frac"]
REFILL = ["train-other/refill_extra_rollouts", "train-other/refill_prompts_consumed",
          "train-other/refill_groups_dropped", "train-other/refill_groups_missing"]
OPTION_RUNS = {
    # 8-bit rollouts (fp8 weights, int8 KV cache): the gap between the 8-bit sampler and the bf16 trainer is
    # what TIS corrects (int8 weights take the same path through the run: tests/rollout/test_quantize.py)
    "tis_token_two_epochs_8bit": (["loss.mismatch_correction=truncate", "train.ppo_epochs=2", "model.dtype=bfloat16",
                                   "rollout.quantize=fp8", "rollout.kv_cache_dtype=int8"], MISMATCH),
    "mis_sequence": (["loss.mismatch_correction=mask", "loss.mismatch_level=sequence", "loss.mismatch_c_min=0.5"],
                     MISMATCH),
    "overlong": (["loss.mask_truncated_completions=true", "task.rewards={correctness: 1.0, overlong: 0.5}",
                  "task.reward_options={overlong: {buffer: 2}}"],
                 ["train-other/truncated_frac", "train-reward/func/overlong/mean"]),
    "entropy_fused": (["loss.top_entropy_quantile=0.2"], ["train-other/entropy_selected_frac"]),
    "entropy_jax": (["loss.top_entropy_quantile=0.2", "loss.impl=jax"], ["train-other/entropy_selected_frac"]),
    "entropy_pallas": (["loss.top_entropy_quantile=0.2", "loss.impl=pallas", "train.steps=1"],
                       ["train-other/entropy_selected_frac"]),
    "refill": (["loss.dynamic_sampling=true", "loss.dynamic_sampling_mode=refill", "loss.max_extra_rollouts=2"],
               REFILL),
    # two epochs: the second update's ratios leave 1, so the cap and the gate act
    "cispo": (["loss.policy_loss=cispo", "train.ppo_epochs=2"], ["train-other/cispo_capped_frac"]),
    "sapo": (["loss.policy_loss=sapo", "train.ppo_epochs=2"], ["train-other/sapo_gate_mean"]),
}


@pytest.fixture(scope="session")
def fast(small_run) -> list[str]:
    """Three small steps of up to 4 tokens (room for the overlong and entropy options)."""
    return [*small_run(3), "rollout.max_new_tokens=4"]


@pytest.fixture
def train(tiny_config, fast) -> Callable[..., list[dict]]:
    """`train(*overrides)`: the metrics records of a fast tiny run with `overrides`, trained in process."""
    def run(*overrides: str) -> list[dict]:
        from grpo_runner_gsm8k.loop import Trainer, build_run

        registry = default_registry()
        cfg = tiny_config(*fast, *overrides, registry=registry)
        Trainer(build_run(cfg, registry)).run()
        return [json.loads(line) for line in (Path(cfg.logging.dir) / "metrics.jsonl").read_text().splitlines()]

    return run


# The options that combine train together in test_options_together_train_and_reach_wandb.
TOGETHER = [("mis_sequence", "overlong", "entropy_fused", "refill"), ("cispo",)]
ALONE = [name for name in OPTION_RUNS if not any(name in group for group in TOGETHER)]


def assert_trained_with_metrics(records: list[dict], keys: list[str]) -> None:
    for record in records:
        assert math.isfinite(record["train-other/loss"]) and record["train-other/skipped_steps"] == 0, record
        for key in keys:
            assert math.isfinite(record[key]), (key, record.get(key))


@pytest.mark.parametrize("name", ALONE)
def test_option_trains_and_logs_its_metrics(train, name, capsys):
    overrides, keys = OPTION_RUNS[name]
    records = train(*overrides)
    out = capsys.readouterr().out
    for mode in ("int8", "fp8"):
        assert (f"rollout: quantize={mode}: sampling from {mode} projection weights" in out) == (
            f"rollout.quantize={mode}" in overrides)
    assert ("rollout: kv_cache_dtype=int8: " in out) == ("rollout.kv_cache_dtype=int8" in overrides)
    assert_trained_with_metrics(records, keys)


@pytest.mark.parametrize("names", TOGETHER, ids=["+".join(names) for names in TOGETHER])
def test_options_together_train_and_reach_wandb(train, tmp_path, names):
    """Options that combine, in one run: each trains and logs its metrics to metrics.jsonl and W&B
    (policy losses exclude each other: cispo runs on its own)."""
    records = train(*sum((OPTION_RUNS[name][0] for name in names), []), "logging.wandb=offline")
    keys = sum((OPTION_RUNS[name][1] for name in names), [])
    assert_trained_with_metrics(records, keys)
    logs = list(tmp_path.glob("run/wandb/offline-run-*/run-*.wandb"))  # under tiny_config's logging.dir
    assert len(logs) == 1
    data = logs[0].read_bytes()
    for key in keys:
        assert key.encode() in data, key


def test_refill_fills_the_batch_with_informative_groups(train):
    """With enough extra rollouts the tiny task (most groups all wrong at first) still trains on
    prompts_per_step informative groups, and each extra rollout draws prompts_per_step prompts."""
    records = train("loss.dynamic_sampling=true", "loss.dynamic_sampling_mode=refill", "loss.max_extra_rollouts=30",
                    "train.steps=2")
    for r in records:
        assert r["train-other/refill_groups_missing"] == 0 and r["train-other/zero_std_frac"] == 0.0, r
        assert r["train-other/refill_prompts_consumed"] == 4 * (1 + r["train-other/refill_extra_rollouts"])
        assert r["train-other/refill_groups_dropped"] >= 1  # the tiny task at step 0 has uninformative groups


def test_correction_with_sampler_logps_says_it_does_nothing(train, capsys):
    train("loss.mismatch_correction=truncate", "rollout.use_sampler_logps=true", "train.steps=1")
    notes = [line for line in capsys.readouterr().err.splitlines() if "has nothing to correct" in line]
    assert len(notes) == 1 and "rollout.use_sampler_logps" in notes[0]


@pytest.mark.parametrize("args,problem", [
    (["loss.mismatch_c_max=0"], "loss.mismatch_c_max = 0.0 is out of range"),
    (["loss.mismatch_c_min=-1"], "loss.mismatch_c_min = -1.0 is out of range"),
    (["loss.mismatch_c_min=3", "loss.mismatch_c_max=2"], "loss.mismatch_c_min = 3.0 is above loss.mismatch_c_max"),
    (["loss.top_entropy_quantile=0"], "loss.top_entropy_quantile = 0.0 is out of range"),
    (["loss.top_entropy_quantile=1.5"], "loss.top_entropy_quantile = 1.5 is out of range"),
    (["loss.dynamic_sampling_mode=refill"], "loss.dynamic_sampling = false"),
    (["loss.max_extra_rollouts=0"], "loss.max_extra_rollouts = 0 is out of range"),
    (["loss.mismatch_correction=clip"], "loss.mismatch_correction = 'clip' has the wrong type"),
    (["loss.policy_loss=ppo"], "loss.policy_loss = 'ppo' has the wrong type"),
    (["loss.policy_loss=cispo", "loss.epsilon_c=3"], "loss.epsilon_c = 3.0 is the dual clip of the clipped surrogate"),
    (["loss.cispo_epsilon_max=0.5"], "loss.cispo_epsilon_max = 0.5 is out of range"),
    (["loss.sapo_temperature_neg=0"], "loss.sapo_temperature_neg = 0.0 is out of range"),
], ids=["c_max_zero", "c_min_negative", "c_min_above_c_max", "quantile_zero", "quantile_above_one",
        "refill_without_dynamic_sampling", "no_extra_rollouts", "unknown_correction", "unknown_policy_loss",
        "dual_clip_with_cispo", "cispo_cap_below_one", "sapo_temperature_zero"])
def test_bad_values_exit_2_with_one_line(tmp_path, tiny_config_path, fast, capsys, args, problem):
    assert main(["--config", tiny_config_path, *fast, f"logging.dir={tmp_path / 'run'}", *args]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("grpo-run: error: ") and problem in lines[0], lines
    assert not (tmp_path / "run").exists()


def test_entropy_selection_with_a_loss_without_entropy_exits_2(tiny_config):
    from grpo_core import LossSpec, NoOptions, hookimpl
    from grpo_core.testing import registry_with
    from grpo_losses import ReferenceLogps

    class NoEntropy:
        @hookimpl
        def grpo_losses(self):
            return [LossSpec("no_entropy", lambda options: ReferenceLogps(), NoOptions, "no entropy",
                             provides_entropy=False)]

    with pytest.raises(Exception) as raised:
        tiny_config("loss.impl=no_entropy", "loss.top_entropy_quantile=0.5", registry=registry_with(NoEntropy()))
    assert "cannot provide the entropy" in str(raised.value) and "loss.top_entropy_quantile=1.0" in str(raised.value)
    assert type(raised.value).__name__ == "ConfigError"


# ---- resume -------------------------------------------------------------------------------------
RESUME = ["train.steps=4", "checkpoint.every_steps=1", "checkpoint.keep=5", "loss.dynamic_sampling=true",
          "loss.dynamic_sampling_mode=refill", "loss.max_extra_rollouts=3"]


@pytest.fixture
def refilling_run(grpo_cli, fast) -> Callable[..., None]:
    """`refilling_run(run_dir, *overrides)`: a refilling run of 4 steps, each saved, in a subprocess."""
    def run(run_dir: Path, *overrides: str) -> None:
        done = grpo_cli.run(grpo_cli.train_argv(*fast, *RESUME, f"logging.dir={run_dir}", *overrides), timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]

    return run


def _final_params(run_dir: Path) -> list[np.ndarray]:
    model, _ = load_policy(run_dir, 4)
    return [np.asarray(x) for x in jax.tree.leaves(nnx.state(model))]


@pytest.mark.slow
def test_refill_resumes_the_data_position_exactly(tmp_path, refilling_run):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    refilling_run(straight)
    refilling_run(resumed, "train.steps=2")
    refilling_run(resumed)  # continues from step 2's checkpoint
    logs = [[json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()] for d in (straight, resumed)]
    assert [r["step"] for r in logs[1]] == [1, 2, 3, 4]
    assert sum(r["train-other/refill_extra_rollouts"] for r in logs[0][2:]) > 0  # the resumed steps refill
    for a, b in zip(logs[0], logs[1]):
        for key in [*REFILL, "train-reward/total/mean", "train-other/loss"]:
            assert a[key] == b[key], (a["step"], key, a[key], b[key])
    for a, b in zip(_final_params(straight), _final_params(resumed), strict=True):
        np.testing.assert_array_equal(a, b)
