"""Errors and warnings of mesh planning and multi-host set-up."""

from grpo_core.errors import UserError


class MeshError(UserError, ValueError):
    """A mesh, batch or process layout that cannot work; the message says what,
    the value seen, and how to fix it. Raised before any compilation."""


class MeshWarning(UserWarning):
    """A layout that works but is probably not what was meant (e.g. fsdp groups
    spanning hosts when host-local sharding was asked for)."""
