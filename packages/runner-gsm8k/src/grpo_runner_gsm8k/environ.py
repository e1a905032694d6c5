"""Environment variables set for one command only: every change to `os.environ` goes
through `environment`, which restores the previous values when the block ends."""

from __future__ import annotations

import contextlib
import os
from typing import Iterator


@contextlib.contextmanager
def environment(**changes: str) -> Iterator[None]:
    """`os.environ` with `changes` for the duration of the block, as it was after."""
    saved = {name: os.environ.get(name) for name in changes}
    os.environ.update(changes)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def unset(**defaults: str) -> dict[str, str]:
    """The `defaults` whose variable is not set: what `environment` should set to keep the user's."""
    return {name: value for name, value in defaults.items() if name not in os.environ}
