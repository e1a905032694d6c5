"""Faults from outside the run, injected for real: a disk that fills during background
checkpoint saves (a small tmpfs), a run directory that turns read-only mid-run (a read-only
bind mount moved over it), and `grpo-run report` on a read-only directory. Each ends in one
`grpo-run: error:` line and no traceback: the run's faults exit 1 (the machine failed, not the
input) and the checkpoints before the fault restore; the report exits 2 (its --out is the fix).

Mounting needs root (CI containers run as root); elsewhere the mount cases skip, and the
failing-writer case of test_resume.py (RLIMIT_FSIZE) covers a failing save without root.
"""

import os
import shutil
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

import pytest

from grpo_runner_gsm8k.operations.checkpoint import complete_steps
from grpo_runner_gsm8k.commands.export import load_policy

pytestmark = pytest.mark.slow

# every step saved and kept, so the fault meets a save whatever the machine's speed
SAVE_EVERY_STEP = ["checkpoint.every_steps=1", "checkpoint.keep=1000"]
TIMEOUT_S = 600


def mount(*args: str) -> None:
    subprocess.run(["mount", *args], check=True, capture_output=True)


def can_mount(tmp_path: Path) -> bool:
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    probe = tmp_path / "probe"
    probe.mkdir()
    try:
        mount("-t", "tmpfs", "-o", "size=1m", "tmpfs", str(probe))
    except subprocess.CalledProcessError:
        return False
    subprocess.run(["umount", str(probe)], check=True)
    return True


@pytest.fixture
def mountable(tmp_path) -> Path:
    if not can_mount(tmp_path):
        pytest.skip("needs root and mount (tmpfs, bind mounts)")
    return tmp_path


@contextmanager
def mounted(target: Path):
    """Unmounts `target` (every mount stacked on it) on the way out."""
    try:
        yield target
    finally:
        while subprocess.run(["umount", str(target)], capture_output=True).returncode == 0:
            pass


@pytest.fixture(scope="session")
def start(grpo_cli, small_run) -> Callable[[Path, Path], subprocess.Popen]:
    """`start(run_dir, log)`: a long small run into `run_dir`, its stderr into `log`."""
    def popen(run_dir: Path, log: Path) -> subprocess.Popen:
        argv = grpo_cli.train_argv(*small_run(400), *SAVE_EVERY_STEP, f"logging.dir={run_dir}")
        return grpo_cli.start(argv, stdout=subprocess.DEVNULL, stderr=log.open("w"))

    return popen


def wait_for_checkpoint(proc: subprocess.Popen, run_dir: Path, step: int, log: Path) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while step not in complete_steps(run_dir):
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.02)


def one_error_line(proc: subprocess.Popen, log: Path) -> str:
    proc.wait(timeout=TIMEOUT_S)
    err = log.read_text()
    assert proc.returncode == 1, err[-3000:]  # a fault of the machine, not bad input
    assert "Traceback" not in err, err[-3000:]
    errors = [line for line in err.splitlines() if line.startswith("grpo-run: error: ")]
    assert len(errors) == 1 and err.strip().splitlines()[-1] == errors[0], err[-3000:]
    return errors[0]


def test_disk_full_during_background_saves_stops_with_one_line(mountable, start, capsys):
    """A 6 MiB tmpfs holds a few checkpoints of the tiny run (~1 MiB each): the save (or the
    metrics write) that finds it full stops the run; the checkpoints before it restore."""
    disk = mountable / "disk"
    disk.mkdir()
    with mounted(disk):
        mount("-t", "tmpfs", "-o", "size=6m", "tmpfs", str(disk))
        run_dir, log = disk / "run", mountable / "run.log"
        proc = start(run_dir, log)
        line = one_error_line(proc, log)
        with capsys.disabled():
            print(f"\ndisk full: {line}")
        assert "No space left on device" in line, line
        assert "saving checkpoint" in line or "metrics.jsonl" in line, line
        kept = complete_steps(run_dir)
        assert kept, "no checkpoint was complete before the disk filled"
        load_policy(run_dir, max(kept))


def test_run_dir_turning_read_only_mid_run_stops_with_one_line(mountable, start, capsys):
    """A read-only bind mount of the run directory, moved over it once checkpoint 2 is
    complete: every later write (the next save) fails with EROFS."""
    run_dir, log, stage = mountable / "run", mountable / "run.log", mountable / "stage"
    stage.mkdir()
    proc = start(run_dir, log)
    with mounted(run_dir):
        try:
            wait_for_checkpoint(proc, run_dir, 2, log)
            mount("--bind", str(run_dir), str(stage))
            mount("-o", "remount,bind,ro", str(stage))  # stage has no open writers: the remount succeeds
            mount("--move", str(stage), str(run_dir))
            line = one_error_line(proc, log)
        finally:
            proc.kill()
            proc.wait(timeout=60)
        with capsys.disabled():
            print(f"\nread-only run dir: {line}")
        assert "Read-only file system" in line, line
        kept = complete_steps(run_dir)
        assert 2 in kept
        load_policy(run_dir, max(kept))


def test_report_on_a_read_only_run_dir_says_where_to_write_instead(mountable, tmp_path, grpo_cli):
    run_dir, stage = tmp_path / "run", tmp_path / "stage"
    run_dir.mkdir()
    stage.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "train-reward/total/mean": 0.5}\n')
    with mounted(run_dir):
        mount("--bind", str(run_dir), str(stage))
        mount("-o", "remount,bind,ro", str(stage))
        mount("--move", str(stage), str(run_dir))
        done = grpo_cli.run(grpo_cli.argv("report", str(run_dir)), timeout=TIMEOUT_S)
        assert done.returncode == 2, done.stderr
        assert done.stderr.strip() == (f"grpo-run: error: cannot write the report '{run_dir / 'report.png'}' "
                                       "(OSError: Read-only file system); pass --out with a path in a writable "
                                       "directory")
        out = tmp_path / "elsewhere.png"
        done = grpo_cli.run(grpo_cli.argv("report", str(run_dir), "--out", str(out)), timeout=TIMEOUT_S)
        assert done.returncode == 0 and out.stat().st_size > 0, done.stderr
