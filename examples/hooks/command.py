"""A `grpo_commands` plugin: `grpo-run last-step RUN_DIR` prints the last logged step's
metrics of a run as one JSON line."""

import json
from pathlib import Path

from grpo_core import CommandSpec, hookimpl
from grpo_core.errors import UserError

def last_step(argv):
    if len(argv) != 1:
        raise UserError(f"usage: grpo-run last-step RUN_DIR (got {len(argv)} arguments)")
    path = Path(argv[0]).expanduser() / "metrics.jsonl"
    if not path.is_file():
        raise UserError(f"{path} does not exist; give the logging.dir of a run")
    lines = path.read_text().splitlines()
    print(lines[-1] if lines else json.dumps({}))
    return 0

@hookimpl
def grpo_commands():
    return [CommandSpec("last-step", last_step, description="the last logged step's metrics of a run")]
