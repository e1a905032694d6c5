"""A few steps of the real loop on the tiny config: metrics, files, W&B offline, NaN skip."""

import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_core import LossSpec, NoOptions, hookimpl
from grpo_core.registry import default_registry
from grpo_core.testing import registry_with
from grpo_losses import TokenLogps, ReferenceLogps

EXPECTED_KEYS = [
    *(f"time/train/{k}" for k in ("rollout_s", "reward_s", "update_s", "step_s", "step_avg_last10_s")),
    "throughput/train/valid_tokens_per_s",
    *(f"train-reward/total/{k}" for k in ("mean", "std", "min", "max")),
    "train-reward/func/correctness/mean", "train-reward/func/correctness/errors",
    *(f"train-other/{k}" for k in ("loss", "entropy", "kl", "clip_frac_low", "clip_frac_high", "grad_norm",
                                   "lr", "skipped_steps", "zero_std_frac", "adv_baseline_mean", "adv_std")),
    *(f"train-seq_len/{part}/{k}" for part in ("prompt", "completion") for k in ("mean", "max")),
    *(f"train-rollout/{k}" for k in ("decode_steps", "tokens_kept", "slot_utilisation", "length_p50",
                                     "length_p90", "length_max")),
    "eval/accuracy",
]


@pytest.fixture
def trainer_of(tiny_config, small_run):
    """`trainer_of(*overrides, registry=None)`: a Trainer of 2 small steps of the tiny config,
    evaluated after the second (run directory: the test's tmp_path / "run")."""
    from grpo_runner_gsm8k.loop import Trainer, build_run

    def build(*overrides: str, registry=None):
        registry = registry or default_registry()
        cfg = tiny_config(*small_run(2, eval_every=2), "rollout.max_new_tokens=4", "eval.num_questions=8", *overrides,
                          registry=registry)
        return Trainer(build_run(cfg, registry))

    return build


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_tiny_run_writes_every_metric(trainer_of, tmp_path):
    trainer_of("loss.beta=0.01", "logging.wandb=offline").run()
    run_dir = tmp_path / "run"
    records = _records(run_dir)
    assert [r["step"] for r in records] == [1, 2]
    for key in EXPECTED_KEYS:
        assert key in records[-1], key
        assert records[-1][key] is not None and math.isfinite(records[-1][key]), (key, records[-1][key])
    assert (run_dir / "config.yaml").is_file()
    # Offline runs keep history and summary in the run's protobuf log; keys are stored as text.
    logs = list(run_dir.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(logs) == 1, list(run_dir.rglob("*"))
    data = logs[0].read_bytes()
    last = records[-1]
    assert last["train-rollout/tokens_kept"] == round(last["train-seq_len/completion/mean"] * 16)
    assert last["train-rollout/length_max"] == last["train-seq_len/completion/max"] == last["train-rollout/decode_steps"]
    for key in ("train-reward/total/mean", "eval/accuracy", "train-other/loss", "train-rollout/slot_utilisation"):
        assert key.encode() in data, key


class NanLoss:
    """A loss implementation whose log-probs are NaN: the update must be skipped."""

    @hookimpl
    def grpo_losses(self):
        def build(options):
            reference = ReferenceLogps()

            def nan_logps(hidden, lm_head, targets, temperature=1.0, *, entropy=False):
                out = reference(hidden, lm_head, targets, temperature, entropy=entropy)
                return TokenLogps(out.logp * jnp.nan, out.entropy)

            return nan_logps

        return [LossSpec("nan_loss", build, NoOptions, "always NaN")]


def test_eval_leaves_the_training_stream_alone(trainer_of, tmp_path):
    """Eval samples from its own key, so evaluating after every step trains exactly as never
    evaluating (a run extended past an end-of-run eval equals one configured longer)."""
    evaluated = trainer_of("eval.every_steps=1")
    evaluated.run()
    plain = trainer_of("eval.every_steps=0", f"logging.dir={tmp_path / 'plain'}")
    plain.run()
    for a, b in zip(jax.tree.leaves(evaluated.state.params), jax.tree.leaves(plain.state.params)):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    assert np.array_equal(jax.random.key_data(evaluated.state.key), jax.random.key_data(plain.state.key))


def test_non_finite_loss_skips_the_update(trainer_of):
    trainer = trainer_of("loss.impl=nan_loss", "eval.every_steps=0", registry=registry_with(NanLoss()))
    initial = jax.tree.map(np.array, trainer.state.params)
    last = trainer.run()
    assert last["train-other/skipped_steps"] == 2
    assert not (math.isfinite(last["train-other/loss"]) and math.isfinite(last["train-other/grad_norm"]))
    diffs = jax.tree.map(lambda a, b: float(np.max(np.abs(np.asarray(a) - b))), trainer.state.params, initial)
    assert max(jax.tree.leaves(diffs)) == 0.0


def test_pallas_loss_runs_per_device_on_the_run_mesh(trainer_of):
    """The run binds its mesh to the pallas loss (Mosaic kernels cannot be partitioned by the
    compiler, so they run per device in shard_map; here interpreted on the CPU devices)."""
    trainer = trainer_of("loss.impl=pallas", "train.steps=1", "eval.every_steps=0")
    last = trainer.run()
    assert trainer.built.plugins.loss_impl.mesh is trainer.built.mesh
    assert math.isfinite(last["train-other/loss"]) and math.isfinite(last["train-other/grad_norm"])
