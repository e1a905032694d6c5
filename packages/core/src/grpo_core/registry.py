"""Plugin discovery (entry-point group `grpo`) and the registry of named specs.

Loading is tolerant per entry point: a plugin that fails to import is reported
with its name, distribution and error, and the others still load.
`GRPO_STRICT_PLUGINS=1` makes such a failure fatal; `GRPO_DISABLE_PLUGINS=a,b`
skips entry points (or distributions) by name.
"""

from __future__ import annotations

import difflib
import importlib.metadata as metadata
import os
import warnings
from dataclasses import dataclass
from typing import Any, Iterable

import pluggy

from grpo_core import hookspecs
from grpo_core.errors import PluginError
from grpo_core.specs import SPEC_TYPES, PluginSpec

ENTRY_POINT_GROUP = "grpo"
HOOK_BY_KIND = {
    "loss": "grpo_losses",
    "mesh": "grpo_meshes",
    "rollout": "grpo_rollouts",
    "reward": "grpo_rewards",
    "task": "grpo_tasks",
    "advantage": "grpo_advantages",
    "command": "grpo_commands",
    "tool": "grpo_tools",
    "environment": "grpo_environments",
    "model_family": "grpo_model_families",
    "grader": "grpo_graders",
}


class PluginLoadWarning(UserWarning):
    """A plugin entry point failed to load and was skipped."""


@dataclass(frozen=True)
class Provided:
    """A spec together with the plugin (entry point) and distribution that provided it."""

    spec: PluginSpec
    plugin: str
    distribution: str


def new_plugin_manager() -> pluggy.PluginManager:
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    return pm


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def _disabled_names() -> set[str]:
    return {n.strip() for n in os.environ.get("GRPO_DISABLE_PLUGINS", "").split(",") if n.strip()}


def _distribution_name(ep: metadata.EntryPoint) -> str:
    return ep.dist.name if ep.dist is not None else "<unknown distribution>"


def load_entry_points(pm: pluggy.PluginManager, strict: bool | None = None) -> dict[str, str]:
    """Registers every `grpo` entry point on `pm`; returns plugin name -> distribution."""
    strict = _env_flag("GRPO_STRICT_PLUGINS") if strict is None else strict
    disabled = _disabled_names()
    loaded = {}
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        dist = _distribution_name(ep)
        if ep.name in disabled or dist in disabled:
            continue
        try:
            pm.register(ep.load(), name=ep.name)
        except Exception as exc:  # a broken third-party plugin must not take the others down
            message = (f"grpo plugin {ep.name!r} (distribution {dist}, {ep.value}) failed to load: "
                       f"{type(exc).__name__}: {exc}")
            if strict:
                raise PluginError(message + " [GRPO_STRICT_PLUGINS=1 makes this fatal]") from exc
            warnings.warn(message + " -- skipped", PluginLoadWarning, stacklevel=2)
            continue
        loaded[ep.name] = dist
    return loaded


class Registry:
    """Every named plugin (loss, mesh, rollout, reward, task, advantage estimator, command, tool,
    environment, model family, grader), by kind and name; the step-end hooks."""

    def __init__(self, pm: pluggy.PluginManager, distributions: dict[str, str] | None = None):
        self._pm = pm
        self._distributions = distributions or {}
        self._by_kind = {kind: self._collect(kind) for kind in HOOK_BY_KIND}

    def _collect(self, kind: str) -> dict[str, Provided]:
        found: dict[str, Provided] = {}
        hook = getattr(self._pm.hook, HOOK_BY_KIND[kind])
        for impl in hook.get_hookimpls():
            plugin = self._pm.get_name(impl.plugin) or repr(impl.plugin)
            for spec in impl.function() or []:
                self._add(found, kind, Provided(spec, plugin, self._distributions.get(plugin, "<inline>")))
        return found

    @staticmethod
    def _add(found: dict[str, Provided], kind: str, item: Provided) -> None:
        expected = SPEC_TYPES[kind]
        if not isinstance(item.spec, expected):
            raise PluginError(f"plugin {item.plugin!r} ({item.distribution}) returned "
                              f"{type(item.spec).__name__} from {HOOK_BY_KIND[kind]}; expected {expected.__name__}")
        name = item.spec.name
        if name in found:
            first = found[name]
            raise PluginError(f"duplicate {kind} name {name!r}: provided by plugin {first.plugin!r} "
                              f"({first.distribution}) and plugin {item.plugin!r} ({item.distribution}); "
                              "disable one with GRPO_DISABLE_PLUGINS=<plugin>")
        found[name] = item

    def names(self, kind: str) -> list[str]:
        return sorted(self._by_kind[kind])

    def entries(self, kind: str) -> list[Provided]:
        return [self._by_kind[kind][n] for n in self.names(kind)]

    def provided(self, kind: str, name: str) -> Provided:
        table = self._by_kind[kind]
        if name not in table:
            available = ", ".join(sorted(table)) or "none registered"
            close = difflib.get_close_matches(name, table, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise PluginError(f"unknown {kind} {name!r}; available: {available}.{hint}")
        return table[name]

    def get(self, kind: str, name: str) -> PluginSpec:
        return self.provided(kind, name).spec

    def loss(self, name: str) -> PluginSpec:
        return self.get("loss", name)

    def mesh(self, name: str) -> PluginSpec:
        return self.get("mesh", name)

    def rollout(self, name: str) -> PluginSpec:
        return self.get("rollout", name)

    def reward(self, name: str) -> PluginSpec:
        return self.get("reward", name)

    def task(self, name: str) -> PluginSpec:
        return self.get("task", name)

    def advantage(self, name: str) -> PluginSpec:
        return self.get("advantage", name)

    def command(self, name: str) -> PluginSpec:
        return self.get("command", name)

    def step_end(self, step: int, metrics: dict[str, Any], run_dir: str) -> None:
        """Every plugin's `grpo_step_end` hook, with one step's metrics."""
        self._pm.hook.grpo_step_end(step=step, metrics=metrics, run_dir=run_dir)

    def tool(self, name: str) -> PluginSpec:
        return self.get("tool", name)

    def environment(self, name: str) -> PluginSpec:
        return self.get("environment", name)

    def model_family(self, name: str) -> PluginSpec:
        return self.get("model_family", name)

    def grader(self, name: str) -> PluginSpec:
        return self.get("grader", name)


def build_registry(extra_plugins: Iterable[Any] = (), *, entry_points: bool = True,
                   strict: bool | None = None) -> Registry:
    """A registry from the installed entry points plus `extra_plugins` (objects with hookimpls)."""
    pm = new_plugin_manager()
    distributions = load_entry_points(pm, strict=strict) if entry_points else {}
    for i, plugin in enumerate(extra_plugins):
        pm.register(plugin, name=getattr(plugin, "__name__", f"inline-{i}"))
    return Registry(pm, distributions)


_default: Registry | None = None


def default_registry() -> Registry:
    """The process-wide registry of installed plugins (loaded once)."""
    global _default
    if _default is None:
        _default = build_registry()
    return _default
