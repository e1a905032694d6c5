"""The run-directory files training rewrites whole (the resolved config.yaml, metrics.jsonl cut back
on resume) are replaced atomically: a kill or a fault mid-write leaves the old file, whole.
Checkpoint items (params, optimizer, meta with the data position and carried partial rows, the
config) are atomic through orbax's temp-directory rename (operations/checkpoint.py); the lock file
is rewritten in place on purpose (its flock is on the inode; its text is informational)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from grpo_runner_gsm8k.assembly import operations
from grpo_runner_gsm8k.operations import atomic
from grpo_runner_gsm8k.operations.atomic import write_text_atomic
from grpo_runner_gsm8k.operations.metrics import truncate_metrics


class Killed(BaseException):
    """Stands for the process dying at the injected point (not an Exception: nothing catches it)."""


def _die(*args, **kwargs):
    raise Killed()


def test_a_write_killed_before_its_rename_leaves_the_old_file_and_no_temp(tmp_path, monkeypatch):
    target = tmp_path / "config.yaml"
    target.write_text("old: 1\n")
    monkeypatch.setattr(atomic.os, "replace", _die)
    with pytest.raises(Killed):
        write_text_atomic(target, "new: 2\n" * 1000)
    assert target.read_text() == "old: 1\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml"]


def test_a_completed_write_replaces_the_file(tmp_path):
    target = tmp_path / "config.yaml"
    target.write_text("old: 1\n")
    write_text_atomic(target, "new: 2\n")
    assert target.read_text() == "new: 2\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml"]


def test_metrics_cut_back_on_resume_survive_a_fault_mid_write(tmp_path, monkeypatch):
    """Resuming from step 2 keeps steps 1-2; a fault while writing the kept lines (here at the
    flush to disk, after the text is written) must not leave metrics.jsonl short of them."""
    path = tmp_path / "metrics.jsonl"
    text = "".join(json.dumps({"step": s, "loss": 0.5}) + "\n" for s in (1, 2, 3, 4))
    path.write_text(text)
    monkeypatch.setattr(atomic.os, "fsync", _die)
    with pytest.raises(Killed):
        truncate_metrics(path, 2)
    assert path.read_text() == text


def test_the_resolved_config_is_written_atomically(tiny_config, tmp_path, monkeypatch):
    written = {}
    monkeypatch.setattr(operations, "write_text_atomic", lambda path, text: written.setdefault(path.name, text))
    cfg = tiny_config()
    run = SimpleNamespace(cfg=cfg, layout=SimpleNamespace(process_index=0), state=SimpleNamespace(step=0))
    operations.metric_sinks(run, tmp_path).close()
    assert written["config.yaml"].startswith("model:\n")
    assert not (tmp_path / "config.yaml").exists()
