"""Helpers for tests that register an inline plugin on a fresh plugin manager.

Example::

    from grpo_core import LossSpec, hookimpl
    from grpo_core.testing import registry_with

    class MyPlugin:
        @hookimpl
        def grpo_losses(self):
            return [LossSpec("mine", build, Options, "my loss")]

    def test_mine():
        registry = registry_with(MyPlugin())
        assert registry.loss("mine").description == "my loss"
"""

from __future__ import annotations

from typing import Any

from grpo_core.registry import Registry, build_registry


def registry_with(*plugins: Any, entry_points: bool = True) -> Registry:
    """A fresh registry holding the installed entry points (unless disabled) plus `plugins`."""
    return build_registry(plugins, entry_points=entry_points)


try:  # a pytest fixture when pytest is importable; grpo-core does not depend on pytest
    import pytest

    @pytest.fixture
    def inline_registry():
        """Call with plugin objects to get a fresh Registry that includes them."""
        return registry_with
except ImportError:  # pragma: no cover
    pass


class Multiply:
    """A minimal tool (the `Tool` contract) for multi-turn tests: the product of two integers."""

    name, description = "multiply", "Multiply two integers."
    parameters = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                  "required": ["a", "b"]}

    def __call__(self, arguments):
        return str(arguments["a"] * arguments["b"])
