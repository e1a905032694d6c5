"""LoRA runs end to end through the CLI, on a base exported by a short full-parameter run:
resume is bitwise (adapters and their optimizer state are the checkpoint), a resume on a
different base is refused naming both, export writes merged weights or a PEFT directory,
and a run started from that PEFT directory begins at its adapters exactly.

The base, one 2-step LoRA run on it and that run's PEFT export are made once and shared (the
tests copy the run before changing it)."""

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from grpo_core.models.peft_io import ADAPTER_WEIGHTS
from grpo_runner_gsm8k.commands.export import saved_lora

pytestmark = pytest.mark.slow

# beta > 0 scores the base as the reference; 16 rows over 8 devices at 1 per device: 2 micro-batches
LORA = ["model.lora.rank=4", "model.lora.alpha=8", "loss.beta=0.05", "train.micro_batch_size_per_device=1",
        "model.remat=full"]


@dataclass(frozen=True)
class Commands:
    """grpo-run commands in subprocesses, each expected to exit with `code`."""

    cli: Any  # tests/conftest.py's Cli
    small: list[str]  # small steps, each saved

    def grpo_run(self, *args: str, code: int = 0) -> subprocess.CompletedProcess:
        done = self.cli.run(self.cli.argv(*args), timeout=600)
        assert done.returncode == code, done.stderr[-3000:]
        return done

    def train(self, run_dir: Path, *overrides: str, code: int = 0) -> subprocess.CompletedProcess:
        return self.grpo_run("--config", self.cli.config, *self.small, f"logging.dir={run_dir}", *overrides, code=code)


@pytest.fixture(scope="session")
def cli(grpo_cli, small_run) -> Commands:
    return Commands(grpo_cli, [*small_run(), "checkpoint.every_steps=1", "checkpoint.keep=9"])


def one_line_error(done: subprocess.CompletedProcess) -> str:
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("grpo-run: error: "), done.stderr
    return lines[0]


@pytest.fixture(scope="module")
def base(tmp_path_factory, cli) -> Path:
    """A base model: 2 full-parameter steps of the tiny config, exported."""
    root = tmp_path_factory.mktemp("base")
    cli.train(root / "full", "train.steps=2")
    cli.grpo_run("export", "--run-dir", str(root / "full"), "--out", str(root / "hf"))
    return root / "hf"


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, base, cli) -> Path:
    """2 LoRA steps on `base`, each saved. Copy it before resuming it."""
    run_dir = tmp_path_factory.mktemp("lora") / "run"
    cli.train(run_dir, f"model.path={base}", *LORA, "train.steps=2")
    return run_dir


@pytest.fixture(scope="module")
def peft(tmp_path_factory, lora_run, cli) -> Path:
    """`lora_run`'s adapters at step 2, exported as a PEFT directory (rank 4, alpha 8)."""
    out = tmp_path_factory.mktemp("peft") / "peft"
    cli.grpo_run("export", "--run-dir", str(lora_run), "--out", str(out), "--peft")
    return out


def adapters_at(run_dir: Path, step: int) -> dict:
    return saved_lora(run_dir, step).arrays()


def test_resumed_lora_run_equals_uninterrupted_bitwise(base, lora_run, tmp_path, cli):
    cli.train(tmp_path / "whole", f"model.path={base}", *LORA, "train.steps=4")
    shutil.copytree(lora_run, tmp_path / "split")
    resumed = cli.train(tmp_path / "split", f"model.path={base}", *LORA, "train.steps=4")
    assert "resumed from step 2" in resumed.stderr
    whole, split = adapters_at(tmp_path / "whole", 4), adapters_at(tmp_path / "split", 4)
    assert any(np.abs(b).max() > 0 for _, b in whole.values())  # B moved off zero: the adapters trained
    for target in whole:
        for x, y in zip(whole[target], split[target]):
            assert np.array_equal(x, y), target


def test_resume_on_another_base_is_refused_naming_both(base, lora_run, tmp_path, cli):
    shutil.copytree(lora_run, tmp_path / "run")
    other = tmp_path / "other"
    shutil.copytree(base, other)
    weights = load_file(other / "model.safetensors")
    weights["model.norm.weight"] = weights["model.norm.weight"] * 1.5
    save_file(weights, other / "model.safetensors", metadata={"format": "pt"})
    line = one_line_error(cli.train(tmp_path / "run", f"model.path={base}", *LORA, "train.steps=3",
                                "model.path=" + str(other), code=2))
    # model.path differs, so the config check names it first; same path, other weights: the fingerprint
    assert "model.path" in line
    shutil.move(base, tmp_path / "base-aside")
    shutil.copytree(other, base)
    try:
        line = one_line_error(cli.train(tmp_path / "run", f"model.path={base}", *LORA, "train.steps=3", code=2))
    finally:
        shutil.rmtree(base)
        shutil.move(tmp_path / "base-aside", base)
    assert "holds adapters of base" in line and "this run's base is" in line and line.count("checksum") == 2


def test_peft_export_then_start_from_it(base, lora_run, peft, tmp_path, cli):
    cli.grpo_run("export", "--run-dir", str(lora_run), "--out", str(tmp_path / "merged"))
    assert (tmp_path / "merged" / "model.safetensors").exists()
    # sgd at lr 1e-30 leaves every float32 adapter entry as it was: step 1 holds the loaded adapters
    cli.train(tmp_path / "second", f"model.path={base}", *LORA, "train.steps=1", "train.optimizer=sgd",
              "train.lr=1e-30", f"model.lora.init_from={peft}")
    cli.grpo_run("export", "--run-dir", str(tmp_path / "second"), "--out", str(tmp_path / "peft2"), "--peft")
    first, second = load_file(peft / ADAPTER_WEIGHTS), load_file(tmp_path / "peft2" / ADAPTER_WEIGHTS)
    assert sorted(first) == sorted(second)
    assert all(np.array_equal(first[k], second[k]) for k in first)


@pytest.mark.parametrize("overrides, expected", [
    (["model.lora.rank=65"], "model.lora.rank: rank 65 is larger than q_proj's dims (64 in, 64 out)"),
    (["model.lora.rank=8", "model.lora.init_from=PEFT"], "holds rank 4, alpha 8"),
])
def test_bad_lora_input_is_one_line(base, peft, tmp_path, overrides, expected, cli):
    overrides = [o.replace("PEFT", str(peft)) for o in overrides]
    line = one_line_error(cli.train(tmp_path / "run", f"model.path={base}", *LORA, *overrides, code=2))
    assert expected in line
    assert not (tmp_path / "run").exists()
