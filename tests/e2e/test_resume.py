"""Checkpoint and resume end to end through the CLI: a run killed with SIGKILL after a
checkpoint and resumed ends bitwise equal to an uninterrupted run; refused resumes exit 2
with one line and change nothing; an unfinished save is ignored.

Every run is a subprocess with the environment of this one (tests/conftest.py: 8 fake CPU
devices), so the killed, the resumed and the reference run share XLA flags.
"""

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from grpo_runner_gsm8k.checkpoint import (checkpoint_dir, complete_steps, config_differences, saved_meta,
                                          truncate_metrics)
from grpo_runner_gsm8k.export import load_policy

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "tiny.yaml"
STEPS = 6
KILL_AFTER = 2  # the kill comes once this step's checkpoint is complete
SHRUNK = [f"train.steps={STEPS}", "rollout.prompts_per_step=4", "rollout.n=4", "eval.every_steps=0",
          "checkpoint.every_steps=1", f"checkpoint.keep={STEPS + 1}"]
RUN_TIMEOUT_S = 600
ERROR_TIMEOUT_S = 120


def command(run_dir: Path, *overrides: str, flags: tuple[str, ...] = ()) -> list[str]:
    return [sys.executable, "-m", "grpo_runner_gsm8k.cli", "--config", str(TINY), *flags, *SHRUNK,
            f"logging.dir={run_dir}", *overrides]


def run_to_end(run_dir: Path, *overrides: str, flags: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    done = subprocess.run(command(run_dir, *overrides, flags=flags), capture_output=True, text=True,
                          cwd=REPO, timeout=RUN_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def refused(run_dir: Path, *overrides: str, flags: tuple[str, ...] = ()) -> str:
    """The one-line error of a run that must exit 2."""
    done = subprocess.run(command(run_dir, *overrides, flags=flags), capture_output=True, text=True,
                          cwd=REPO, timeout=ERROR_TIMEOUT_S)
    assert done.returncode == 2, (done.returncode, done.stderr[-3000:])
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("grpo-run: error: "), done.stderr
    return lines[0]


def logged_steps(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def final_params(run_dir: Path) -> list[np.ndarray]:
    model, _ = load_policy(run_dir, STEPS)
    return [np.asarray(x) for x in jax.tree.leaves(nnx.state(model))]


def max_abs_param_diff(run_a: Path, run_b: Path) -> float:
    pairs = zip(final_params(run_a), final_params(run_b), strict=True)
    return max(float(np.max(np.abs(a - b))) for a, b in pairs)


def files_of(run_dir: Path) -> dict[str, int]:
    return {str(p.relative_to(run_dir)): p.stat().st_mtime_ns for p in run_dir.rglob("*")}


def kill_after_checkpoint(run_dir: Path, step: int, log: Path) -> int:
    """Starts a run, SIGKILLs it as soon as checkpoint `step` is complete, returns the
    newest complete checkpoint left behind."""
    with open(log, "w") as stderr:
        proc = subprocess.Popen(command(run_dir), stdout=subprocess.DEVNULL, stderr=stderr, cwd=REPO)
        try:
            deadline = time.monotonic() + RUN_TIMEOUT_S
            while step not in complete_steps(run_dir):
                assert proc.poll() is None, f"run exited ({proc.returncode}) before checkpoint {step}:\n" + \
                    log.read_text()[-3000:]
                assert time.monotonic() < deadline, f"no checkpoint {step} within {RUN_TIMEOUT_S}s"
                time.sleep(0.05)
            proc.send_signal(signal.SIGKILL)
        finally:
            proc.kill()  # no-op after the SIGKILL; ends the run if an assertion failed
            proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    return max(complete_steps(run_dir))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("uninterrupted")
    run_to_end(run_dir)
    return run_dir


def test_sigkill_then_resume_ends_bitwise_equal(uninterrupted, tmp_path, capsys):
    run_dir = tmp_path / "killed"
    killed_at = kill_after_checkpoint(run_dir, KILL_AFTER, tmp_path / "killed.log")
    assert killed_at < STEPS, "the run ended before the kill; nothing was resumed"

    resumed = run_to_end(run_dir, flags=("--resume",))
    assert f"resumed from step {killed_at} of " in resumed.stderr

    diff = max_abs_param_diff(uninterrupted, run_dir)
    with capsys.disabled():
        print(f"\nSIGKILL after checkpoint {killed_at}, resumed to step {STEPS}: "
              f"max abs param diff vs uninterrupted run = {diff}")
    assert diff == 0.0
    reference, records = logged_steps(uninterrupted), logged_steps(run_dir)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))  # no duplicates after the resume
    for key in ("train-other/loss", "train-other/grad_norm", "train-reward/total/mean"):
        assert [r[key] for r in records] == [r[key] for r in reference], key
    for key in ("key", "data", "skipped_steps", "step"):
        assert saved_meta(run_dir, STEPS)[key] == saved_meta(uninterrupted, STEPS)[key], key


def test_resume_flag_without_checkpoint_exits_2_and_writes_nothing(tmp_path):
    run_dir = tmp_path / "never-ran"
    message = refused(run_dir, flags=("--resume",))
    assert "--resume: no complete checkpoint in" in message and str(run_dir) in message
    assert not run_dir.exists()


def test_resume_with_incompatible_config_exits_2_naming_the_keys(uninterrupted):
    before = files_of(uninterrupted)
    message = refused(uninterrupted, "rollout.n=8", "model.architecture.hidden_size=32", "train.optimizer=sgd")
    assert "rollout.n (saved 4, now 8)" in message
    assert "model.architecture.hidden_size (saved 64, now 32)" in message
    assert 'train.optimizer (saved "adamw", now "sgd")' in message
    assert files_of(uninterrupted) == before


def test_unfinished_save_is_ignored_and_cleaned_up(uninterrupted, tmp_path):
    run_dir = tmp_path / "copy"
    shutil.copytree(uninterrupted, run_dir)
    # What a kill during the save of the next step leaves: a tmp directory, half written.
    unfinished = checkpoint_dir(run_dir) / f"{STEPS + 1}.orbax-checkpoint-tmp"
    shutil.copytree(checkpoint_dir(run_dir) / str(STEPS), unfinished)
    shutil.rmtree(unfinished / "params")
    assert complete_steps(run_dir)[-1] == STEPS

    resumed = run_to_end(run_dir, f"train.steps={STEPS + 1}")  # checkpoint.resume=auto, no flag
    assert f"resumed from step {STEPS} of " in resumed.stderr
    assert complete_steps(run_dir)[-1] == STEPS + 1
    assert not unfinished.exists()
    assert [r["step"] for r in logged_steps(run_dir)] == list(range(1, STEPS + 2))


def test_only_settings_that_keep_the_math_may_change_on_resume():
    saved = {"train": {"steps": 6, "lr": 1e-3, "micro_batch_size_per_device": 0}, "logging": {"dir": "a"},
             "model": {"architecture": {"hidden_size": 64}, "remat": "none"}, "task": {"options": {}}}
    changed = {"train": {"steps": 9, "lr": 1e-3, "micro_batch_size_per_device": 2}, "logging": {"dir": "b"},
               "model": {"architecture": {"hidden_size": 64}, "remat": "full"}, "task": {"options": {}}}
    assert config_differences(saved, changed) == {}
    changed["task"]["options"] = {"digits": 2}
    changed["train"]["lr"] = 2e-3
    differences = config_differences(saved, changed)
    assert sorted(differences) == ["task.options.digits", "train.lr"]
    assert differences["train.lr"] == (1e-3, 2e-3) and differences["task.options.digits"][1] == 2


def test_truncated_metrics_keep_steps_up_to_the_checkpoint(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "x": s}) + "\n" for s in (1, 2, 3)) + '{"step": 4, "x')
    truncate_metrics(path, 2)
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2]
