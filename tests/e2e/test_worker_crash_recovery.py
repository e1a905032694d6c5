"""The suite's xdist scheduling (tests/conftest.py) after a worker crash: the test the worker
died in runs once more in a new worker and fails if it crashes again, every other test still
runs, and the run ends."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

CRASHING_TESTS = """import os
from pathlib import Path


def test_crashes_every_time():
    os._exit(1)


def test_crashes_the_first_time():
    marker = Path(__file__).with_name("crashed-once")
    if not marker.exists():
        marker.touch()
        os._exit(1)


def test_after():
    pass
"""


# One worker: its replacement is handed the crashed one-test unit and must also be told no more
# work comes (xdist 3.8 left it waiting forever). Two: both crash near the same time, and the
# replacement of the first must get no work before it has collected (xdist lost a unit there).
@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_crash_is_run_once_more_and_the_run_still_ends(tmp_path, workers):
    tests = tmp_path / "tests"
    tests.mkdir()
    shutil.copy(REPO / "tests" / "conftest.py", tests / "conftest.py")
    # Many finished units on the worker before it dies: those are what xdist 3.8 re-queued.
    (tests / "test_many.py").write_text(
        "import pytest\n\n@pytest.mark.parametrize('i', range(40))\ndef test_pass(i):\n    pass\n")
    (tests / "test_z_crash.py").write_text(CRASHING_TESTS)
    run = subprocess.run([sys.executable, "-m", "pytest", "-n", workers, "-p", "no:cacheprovider", "-q", str(tests)],
                         cwd=tmp_path, capture_output=True, text=True, timeout=240)
    summary = run.stdout.strip().splitlines()[-1]
    assert "1 failed, 42 passed" in summary, run.stdout[-3000:]
    for name in ("test_crashes_every_time", "test_crashes_the_first_time"):
        assert f"crashed in tests/test_z_crash.py::{name}: running it once more" in run.stdout
    assert "crashed while running 'tests/test_z_crash.py::test_crashes_every_time'" in run.stdout
