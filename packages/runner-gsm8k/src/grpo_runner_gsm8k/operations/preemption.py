"""Graceful stop on SIGTERM (how spot/preemptible VMs and schedulers stop a job) and SIGINT.

The first signal only sets a flag: the step in progress finishes, the loop saves a
checkpoint and exits with one line and the exit status 128 + the signal number (143
for SIGTERM, 130 for SIGINT), the status a killed job has, so schedulers still see an
interrupted job, while the saved checkpoint lets the same command continue it. A second
signal stops the process at once.

Multi-host: processes are signalled at slightly different times, so after every step
they all-gather their flags and all stop (and save) after the same step.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Optional

import numpy as np

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Stopped(Exception):
    """The run stopped early on a signal after saving; `exit_code` is 128 + the signal."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


class StopRequest:
    """Turns SIGTERM/SIGINT into a flag the training loop polls between steps."""

    def __init__(self):
        self.signum: Optional[int] = None
        self._previous: dict = {}

    def __enter__(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():  # Python handles signals there only
            self._previous = {s: signal.signal(s, self._handle) for s in STOP_SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def _handle(self, signum: int, frame) -> None:
        if self.signum is not None:  # asked twice: do not wait for the step
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
        self.signum = signum

    def agreed(self) -> bool:
        """True on every process as soon as any process was signalled (a collective: every
        process calls it after every step)."""
        import jax
        from jax.experimental import multihost_utils

        local = self.signum is not None
        if jax.process_count() == 1:
            return local
        flags = multihost_utils.process_allgather(np.array([int(local)], np.int32))
        return bool(np.any(np.asarray(flags)))

    def stopped(self, step: int, total: int, checkpoint: str) -> Stopped:
        signum = self.signum or signal.SIGTERM  # another process was signalled
        name = signal.Signals(signum).name if self.signum else "a signal to another process"
        return Stopped(f"stopped by {name} after step {step} of {total}; saved checkpoint {checkpoint}; "
                       "run the same command again to continue", 128 + int(signum))
