"""Tools and environments in the registry: found by name, duplicates and unknown names refused."""

import pytest

from grpo_core import EnvironmentSpec, NoOptions, ToolSpec, hookimpl
from grpo_core.errors import PluginError
from grpo_core.registry import build_registry


def _build(options):
    return options


class Tools:
    @hookimpl
    def grpo_tools(self):
        return [ToolSpec("search", _build, NoOptions, "find things")]

    @hookimpl
    def grpo_environments(self):
        return [EnvironmentSpec("maze", _build, NoOptions, "walk a maze")]


def test_tools_and_environments_are_found_by_name():
    registry = build_registry([Tools()], entry_points=False)
    assert registry.tool("search").description == "find things"
    assert registry.environment("maze").kind == "environment"
    assert registry.names("tool") == ["search"] and registry.provided("tool", "search").distribution == "<inline>"


def test_an_unknown_tool_lists_the_available_ones():
    registry = build_registry([Tools()], entry_points=False)
    with pytest.raises(PluginError, match=r"unknown tool 'serch'; available: search\. Did you mean 'search'"):
        registry.tool("serch")
    with pytest.raises(PluginError, match=r"unknown environment 'chess'; available: maze\."):
        registry.environment("chess")


def test_a_duplicate_tool_names_both_providers():
    first, second = Tools(), Tools()
    first.__name__, second.__name__ = "first", "second"
    with pytest.raises(PluginError, match="duplicate tool name 'search': provided by plugin '(first|second)'"):
        build_registry([first, second], entry_points=False)


def test_a_tool_spec_from_the_environment_hook_is_refused():
    class Wrong:
        @hookimpl
        def grpo_environments(self):
            return [ToolSpec("search", _build, NoOptions, "")]

    with pytest.raises(PluginError, match="returned ToolSpec from grpo_environments; expected EnvironmentSpec"):
        build_registry([Wrong()], entry_points=False)
