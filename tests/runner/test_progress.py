"""Progress on a non-TTY (log files, CI): a line every logging.every_steps and one summary."""

import io
from pathlib import Path

from grpo_core.config import LoggingConfig
from grpo_runner_gsm8k.operations.metrics import Progress


def test_tiny_run_prints_at_most_30_lines_with_the_default():
    stream = io.StringIO()
    progress = Progress(600, LoggingConfig().every_steps, stream=stream)
    for step in range(1, 601):
        progress.update(step, {"train-reward/total/mean": 0.5, "eval/accuracy": 0.9} if step == 600 else {})
    progress.summary({"eval/accuracy": 0.891}, Path("/runs/tiny"), "/runs/tiny/checkpoints/600")
    lines = stream.getvalue().splitlines()
    assert len(lines) == 600 // 25 + 1 <= 30
    assert lines[-2].startswith("step 600/600 ")
    assert lines[-1].startswith("done: final eval accuracy 0.891, wall time ")
    assert lines[-1].endswith("run dir /runs/tiny, last checkpoint /runs/tiny/checkpoints/600")


def test_the_progress_line_shows_slot_utilisation_when_reported():
    stream = io.StringIO()
    Progress(2, 1, stream=stream).update(1, {"train-rollout/slot_utilisation": 0.183})
    assert " slots 0.18 " in stream.getvalue()
