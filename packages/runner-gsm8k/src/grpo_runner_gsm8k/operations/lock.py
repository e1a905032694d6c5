"""One run per `logging.dir`: an advisory lock file naming its holder.

`<logging.dir>/.lock` is locked with flock(2) for the life of the run and holds the
holder's pid and host. The kernel drops the lock when the holder dies, so a lock left by
a crashed or killed run is stale and the next run takes it over (saying whose it was);
a live holder makes the next run stop with one line naming it.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
from pathlib import Path

from grpo_core.errors import UserError

LOCK_FILE = ".lock"


def _holder(text: str) -> str:
    try:
        record = json.loads(text)
        return f"pid {record['pid']} on host {record['host']}"
    except (ValueError, KeyError, TypeError):
        return "an unknown process"


class RunDirLock:
    """Held from `acquire` until `release` (or the process ends)."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / LOCK_FILE
        self.file = None

    def acquire(self) -> "RunDirLock":
        file = open(self.path, "a+")
        file.seek(0)
        previous = file.read()
        try:
            fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            file.close()
            raise UserError(f"logging.dir {str(self.path.parent)!r} is in use by {_holder(previous)} (lock file "
                            f"{self.path}); wait for that run to end, or set logging.dir to another directory") from None
        if previous.strip():
            print(f"grpo-run: warning: took over the stale lock of {_holder(previous)} on {self.path.parent}",
                  file=sys.stderr)
        file.truncate(0)
        file.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname()}))
        file.flush()
        self.file = file
        return self

    def release(self) -> None:
        if self.file is not None:
            self.file.truncate(0)  # an empty lock file is not stale: the run ended cleanly
            self.file.close()  # closing drops the flock
            self.file = None
