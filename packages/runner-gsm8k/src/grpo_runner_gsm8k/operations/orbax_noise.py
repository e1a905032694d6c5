"""orbax's noise around a failed background save, dropped once for the process.

A failed checkpoint write is reported by the run in one line (see checkpoint.Checkpointer);
orbax, TensorStore and asyncio repeat it as tracebacks, log records and warnings on their
own threads. `install` (called once when `grpo-run` starts) drops those repeats and passes
everything else on; `quiet_after_failed_save` silences the rest once a save has failed.
"""

from __future__ import annotations

import logging
import sys
import threading
import warnings


def install() -> None:
    """Every filter and hook below; idempotent."""
    # orbax logs a failed background save with a traceback; the run reports it in one line.
    logging.getLogger("absl").setLevel(logging.CRITICAL)
    drop_closed_loop_errors()
    drop_unretrieved_save_tasks()


def quiet_after_failed_save() -> None:
    """After a failed save is reported, orbax's threads and write tasks may still fail while
    the process exits; their reports would only repeat that error."""
    threading.excepthook = _quiet_thread_errors
    sys.unraisablehook = _quiet_thread_errors
    logging.getLogger("asyncio").setLevel(logging.CRITICAL)  # orbax's failed write tasks, never awaited
    # the run ends on this error; any write coroutine orbax abandoned with the save is moot
    warnings.filterwarnings("ignore", message=r"coroutine '.*' was never awaited", category=RuntimeWarning)


def _closed_loop_noise(exc: BaseException | None) -> bool:
    return isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed"


def drop_closed_loop_errors() -> None:
    """When a write of orbax's async save fails, TensorStore's completion callbacks of the
    other writes race the save's event-loop shutdown and raise 'Event loop is closed' on
    TensorStore's threads, reported through sys.excepthook / sys.unraisablehook. They only
    repeat a failure the run reports in one line: drop them, pass everything else on."""
    if getattr(sys.excepthook, "drops_closed_loop_errors", False):
        return
    previous_excepthook, previous_unraisablehook = sys.excepthook, sys.unraisablehook

    def excepthook(kind, value, tb):
        if not _closed_loop_noise(value):
            previous_excepthook(kind, value, tb)

    def unraisablehook(args):
        if not _closed_loop_noise(args.exc_value):
            previous_unraisablehook(args)

    excepthook.drops_closed_loop_errors = True
    sys.excepthook, sys.unraisablehook = excepthook, unraisablehook


class _UnretrievedSaveTasks(logging.Filter):
    """Drops asyncio's 'Task exception was never retrieved' records of orbax's write tasks:
    when a write fails, its sibling tasks may be garbage-collected before the run checks the
    save, and the failure reaches the user as the run's one error line anyway."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not (message.startswith("Task exception was never retrieved") and "orbax" in message)


def drop_unretrieved_save_tasks() -> None:
    """Also the RuntimeWarning for the write coroutines a failed save never started (emitted
    whenever they are garbage-collected, at exit too)."""
    warnings.filterwarnings("ignore", message=r"coroutine 'async_serialize_from_host\.", category=RuntimeWarning)
    asyncio_logger = logging.getLogger("asyncio")
    if not any(isinstance(f, _UnretrievedSaveTasks) for f in asyncio_logger.filters):
        asyncio_logger.addFilter(_UnretrievedSaveTasks())


def _quiet_thread_errors(args) -> None:  # noqa: ARG001
    """After a failed save is reported, orbax's background threads may still fail while the
    process exits; their tracebacks would only repeat that error."""
