"""The run directory's write probe: every process of a multi-host run probes the same shared
directory at once, so one process's probe must never touch another's."""

from __future__ import annotations

from types import SimpleNamespace

from grpo_runner_gsm8k.assembly.build import prepare_run_dir


def config(run_dir) -> SimpleNamespace:
    """The logging section: prepare_run_dir reads only its dir."""
    return SimpleNamespace(dir=str(run_dir))


def test_probe_leaves_another_process_probe_alone(tmp_path):
    others = tmp_path / ".write-test"  # the fixed name every process once used
    others.write_text("")
    assert prepare_run_dir(config(tmp_path)) == tmp_path
    assert sorted(p.name for p in tmp_path.iterdir()) == [".write-test"]


def test_probe_creates_the_directory_and_leaves_it_empty(tmp_path):
    run_dir = tmp_path / "a" / "run"
    prepare_run_dir(config(run_dir))
    assert run_dir.is_dir() and not list(run_dir.iterdir())
