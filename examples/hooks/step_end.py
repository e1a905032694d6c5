"""A `grpo_step_end` plugin: an extra logger, appending each step's reward and loss to
`<run dir>/rewards.tsv` (every process calls the hook; process 0's file is the one kept)."""

import math
from pathlib import Path

from grpo_core import hookimpl

COLUMNS = ("train-reward/total/mean", "train-other/loss")

@hookimpl
def grpo_step_end(step, metrics, run_dir):
    path = Path(run_dir) / "rewards.tsv"
    values = [metrics.get(name, math.nan) for name in COLUMNS]
    with path.open("a") as out:
        out.write("\t".join([str(step), *(f"{v:.6g}" for v in values)]) + "\n")
