"""The suite's xdist scheduling (tests/conftest.py) after a worker crash: the test the worker
died in is reported failed once, every other test still runs, and the run ends."""

import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_a_crashed_worker_fails_its_test_once_and_the_run_still_ends(tmp_path):
    tests = tmp_path / "tests"
    tests.mkdir()
    shutil.copy(REPO / "tests" / "conftest.py", tests / "conftest.py")
    # Many finished units on the worker before it dies: those are what xdist 3.8 re-queued.
    (tests / "test_many.py").write_text(
        "import pytest\n\n@pytest.mark.parametrize('i', range(40))\ndef test_pass(i):\n    pass\n")
    (tests / "test_z_crash.py").write_text(
        "import os\n\ndef test_crash():\n    os._exit(1)\n\ndef test_after():\n    pass\n")
    run = subprocess.run([sys.executable, "-m", "pytest", "-n", "2", "-p", "no:cacheprovider", "-q", str(tests)],
                         cwd=tmp_path, capture_output=True, text=True, timeout=180)
    summary = run.stdout.strip().splitlines()[-1]
    assert "1 failed, 41 passed" in summary, run.stdout[-3000:]
    assert "crashed while running 'tests/test_z_crash.py::test_crash'" in run.stdout
