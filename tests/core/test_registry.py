"""Plugin loading and the registry, with inline plugins on fresh plugin managers."""

import importlib.metadata as metadata
import warnings
from dataclasses import dataclass

import pytest

from grpo_core import AdvantageSpec, LossSpec, MeshSpec, RewardSpec, hookimpl
from grpo_core.errors import PluginError
from grpo_core.registry import PluginLoadWarning, Registry, build_registry, load_entry_points, new_plugin_manager
from grpo_core.testing import registry_with


@dataclass(frozen=True)
class BlockOptions:
    block: int = 128


def _build(options):
    return lambda *args: options


class ThirdParty:
    """What an outside package registers: a loss and a mesh."""

    @hookimpl
    def grpo_losses(self):
        return [LossSpec("toy_loss", _build, BlockOptions, "a toy loss")]

    @hookimpl
    def grpo_meshes(self):
        return [MeshSpec("toy_mesh", _build, BlockOptions, "a toy mesh")]


def test_inline_plugin_adds_loss_and_mesh():
    registry = registry_with(ThirdParty(), entry_points=False)
    assert registry.loss("toy_loss").description == "a toy loss"
    assert registry.mesh("toy_mesh").options is BlockOptions
    assert registry.names("loss") == ["toy_loss"]
    assert registry.provided("loss", "toy_loss").distribution == "<inline>"


def test_inline_registry_fixture(inline_registry):
    assert inline_registry(ThirdParty(), entry_points=False).mesh("toy_mesh").name == "toy_mesh"


def test_unknown_name_lists_available_and_suggests():
    registry = registry_with(ThirdParty(), entry_points=False)
    with pytest.raises(PluginError, match=r"unknown loss 'toy_los'; available: toy_loss\. Did you mean 'toy_loss'"):
        registry.loss("toy_los")


def test_duplicate_names_name_both_providers():
    class Other:
        @hookimpl
        def grpo_losses(self):
            return [LossSpec("toy_loss", _build, BlockOptions, "clash")]

    with pytest.raises(PluginError, match="duplicate loss name 'toy_loss'.*'first'.*'second'|duplicate loss name 'toy_loss'.*'second'.*'first'"):
        first, second = ThirdParty(), Other()
        first.__name__, second.__name__ = "first", "second"
        build_registry([first, second], entry_points=False)


def test_wrong_record_type_is_rejected():
    class Wrong:
        @hookimpl
        def grpo_losses(self):
            return [RewardSpec("r", _build, BlockOptions, "reward in the loss hook")]

    with pytest.raises(PluginError, match="expected LossSpec"):
        build_registry([Wrong()], entry_points=False)


def test_spec_validates_its_fields():
    with pytest.raises(TypeError, match="options must be a dataclass"):
        LossSpec("x", _build, dict, "bad options")
    with pytest.raises(ValueError, match="name must be a non-empty string"):
        LossSpec("", _build, BlockOptions, "no name")


class _FakeEntryPoint:
    """Stands in for an installed entry point whose module raises ImportError."""

    def __init__(self, name, loader):
        self.name, self.value, self._loader = name, f"{name}.plugin", loader
        self.dist = type("Dist", (), {"name": f"{name}-dist"})()

    def load(self):
        return self._loader()


def _broken():
    raise ImportError("No module named 'missing_dependency'")


def _working():
    return ThirdParty()


@pytest.fixture
def fake_entry_points(monkeypatch):
    eps = [_FakeEntryPoint("broken", _broken), _FakeEntryPoint("working", _working)]
    monkeypatch.setattr(metadata, "entry_points", lambda group: eps if group == "grpo" else [])
    return eps


def test_broken_plugin_is_skipped_with_warning(fake_entry_points, monkeypatch):
    monkeypatch.delenv("GRPO_STRICT_PLUGINS", raising=False)
    pm = new_plugin_manager()
    with pytest.warns(PluginLoadWarning, match=r"'broken' \(distribution broken-dist.*ImportError.*missing_dependency"):
        loaded = load_entry_points(pm)
    assert loaded == {"working": "working-dist"}
    assert Registry(pm, loaded).provided("loss", "toy_loss").distribution == "working-dist"


def test_broken_plugin_is_fatal_in_strict_mode(fake_entry_points, monkeypatch):
    monkeypatch.setenv("GRPO_STRICT_PLUGINS", "1")
    with pytest.raises(PluginError, match="'broken'.*GRPO_STRICT_PLUGINS=1"):
        load_entry_points(new_plugin_manager())


def test_disabled_plugins_are_not_loaded(fake_entry_points, monkeypatch):
    monkeypatch.setenv("GRPO_STRICT_PLUGINS", "1")
    monkeypatch.setenv("GRPO_DISABLE_PLUGINS", "broken, other")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_entry_points(new_plugin_manager()) == {"working": "working-dist"}


class Estimators:
    """An outside package's advantage estimator."""

    def __init__(self, plugin: str = "estimators"):
        self.__name__ = plugin

    @hookimpl
    def grpo_advantages(self):
        return [AdvantageSpec("toy_adv", _build, BlockOptions, "a toy estimator")]


def test_advantage_estimators_are_a_kind_of_their_own():
    registry = registry_with(Estimators(), entry_points=False)
    assert registry.advantage("toy_adv").description == "a toy estimator"
    assert registry.names("advantage") == ["toy_adv"] and registry.names("loss") == []
    with pytest.raises(PluginError, match=r"unknown advantage 'toy'; available: toy_adv\. Did you mean 'toy_adv'"):
        registry.advantage("toy")
    with pytest.raises(PluginError, match="duplicate advantage name 'toy_adv': provided by plugin 'first'.*'second'"):
        build_registry([Estimators("first"), Estimators("second")], entry_points=False)


def test_a_loss_record_from_the_advantage_hook_is_rejected():
    class Wrong:
        @hookimpl
        def grpo_advantages(self):
            return [LossSpec("l", _build, BlockOptions, "loss in the advantage hook")]

    with pytest.raises(PluginError, match="returned LossSpec from grpo_advantages; expected AdvantageSpec"):
        build_registry([Wrong()], entry_points=False)
