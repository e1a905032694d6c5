"""Whole-file writes of a run's state files: a kill leaves the old file or the new one, never half.

The text goes to a temp file beside the target (same directory, so the same filesystem), is
flushed to disk, and replaces the target by rename (atomic on POSIX filesystems); the directory is
then synced too, so the rename itself survives a power cut. A temp file
left by a kill has a name of its own (`.<name>.<random>.tmp`) that nothing reads. Each writer
gets its own temp file, so the processes of a multi-host run may write the same target.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_text_atomic(path: Path, text: str) -> None:
    path = Path(path)
    fd, temp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as file:
            file.write(text)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temp, path)
    except BaseException:
        _remove(temp)
        raise
    _sync_directory(path.parent)


def _sync_directory(directory: Path) -> None:
    handle = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(handle)
    finally:
        os.close(handle)


def _remove(temp: str) -> None:
    try:
        os.unlink(temp)
    except OSError:
        pass  # already gone, or the directory turned read-only: the temp name is ignored anyway
