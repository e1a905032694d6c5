"""What `grpo-run` does with an exception no check foresaw: one line on stderr naming what
failed, where and the cause, and a crash log (traceback, config, versions) in the run
directory, or in the temp directory when the run has none yet.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import platform
import sys
import tempfile
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

EXIT_CRASH = 1
PACKAGES = ("grpo-core", "grpo-losses", "grpo-meshes", "grpo-rollout", "grpo-runner-gsm8k", "jax", "jaxlib",
            "flax", "optax", "orbax-checkpoint", "numpy", "transformers")


@dataclass
class CrashContext:
    """What the crash log can say about the run; filled in as the command learns it."""

    argv: tuple[str, ...] = ()
    run_dir: Optional[Path] = None
    config_yaml: str = ""


CONTEXT = CrashContext()


def begin(argv: list[str]) -> None:
    """A fresh context for one command (tests run several in one process)."""
    CONTEXT.argv, CONTEXT.run_dir, CONTEXT.config_yaml = tuple(argv), None, ""


def versions() -> list[str]:
    lines = [f"python {platform.python_version()} ({platform.platform()})"]
    for name in PACKAGES:
        try:
            lines.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            lines.append(f"{name} not installed")
    return lines


def crash_report(exc: BaseException, context: CrashContext) -> str:
    trace = "".join(traceback.format_exception(exc))
    return "\n".join([f"grpo-run crash, {datetime.datetime.now(datetime.timezone.utc).isoformat()}",
                      f"command: grpo-run {' '.join(context.argv)}", "", "traceback:", trace, "versions:",
                      *versions(), "", "config:", context.config_yaml or "(not loaded)", ""])


def _log_dirs(context: CrashContext) -> list[Path]:
    """The run directory when the run made it, then the temp directory."""
    dirs = [context.run_dir] if context.run_dir is not None and context.run_dir.is_dir() else []
    return dirs + [Path(tempfile.gettempdir())]


def write_crash_log(exc: BaseException, context: CrashContext) -> tuple[Optional[Path], str]:
    """(path of the log written, "") or (None, why none could be written)."""
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%S.%fZ")
    text, why = crash_report(exc, context), ""
    for folder in _log_dirs(context):
        path = folder / f"crash-{stamp}.log"
        try:
            path.write_text(text, encoding="utf-8")
            return path, ""
        except OSError as error:  # a full or read-only run dir: try the next place
            why = f"{type(error).__name__}: {error.strerror or error}"
    return None, why


def where_raised(exc: BaseException) -> str:
    """file:line (function) of the innermost frame in grpo-jax's own code, else the innermost."""
    frames = traceback.extract_tb(exc.__traceback__)
    ours = [f for f in frames if "grpo_" in f.filename] or frames
    if not ours:
        return "an unknown place"
    frame = ours[-1]
    return f"{Path(frame.filename).name}:{frame.lineno} ({frame.name})"


def cause(exc: BaseException) -> str:
    """The cause on one short line (the operating-system error when there is one)."""
    try:
        from grpo_runner_gsm8k.operations.checkpoint import cause_of
    except Exception:  # noqa: BLE001 - the boundary must answer even when the checkpoint stack cannot import
        return f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
    return cause_of(exc)


def crash_line(exc: BaseException, log: Optional[Path], why_no_log: str) -> str:
    record = (f"traceback, config and versions in {log}" if log is not None
              else f"no crash log could be written ({why_no_log})")
    return (f"grpo-run: error: unexpected error in {where_raised(exc)}: {cause(exc)}; {record}; "
            "rerun with --debug to see the traceback here")


def report_crash(exc: BaseException, debug: bool, context: Any = CONTEXT) -> int:
    """Writes the crash log, prints the one line (and the traceback with --debug); the exit code."""
    if debug:
        traceback.print_exception(exc)
    log, why = write_crash_log(exc, context)
    print(crash_line(exc, log, why), file=sys.stderr)
    return EXIT_CRASH
