"""Load-time checks of `rollout.multi_turn` (called by config_io): every one a one-line
ConfigError, so `grpo-run` exits 2 before any device work."""

from __future__ import annotations

from typing import Any

from grpo_core.config_unused import refuse_unused
from grpo_core.errors import ConfigError, PluginError

# what only a multi-turn rollout reads: accepted and ignored without it, so refused
MULTI_TURN_KEYS = ("tools", "tool_options", "environment", "environment_options", "max_turns", "max_total_tokens",
                   "call_timeout_s", "kv_cache")


def check_multi_turn(cfg: Any) -> None:
    """Cross-field checks of rollout.multi_turn (no registry needed)."""
    multi = cfg.rollout.multi_turn
    if not multi.enabled:
        refuse_unused(multi, "rollout.multi_turn", MULTI_TURN_KEYS, "rollout.multi_turn.enabled is false, so rows "
                      "are sampled in one turn", "set rollout.multi_turn.enabled=true")
        return
    if not multi.tools and multi.environment is None:
        raise ConfigError("rollout.multi_turn.enabled with rollout.multi_turn.tools = [] and no environment: offer "
                          "at least one tool, e.g. rollout.multi_turn.tools=[calculator], or set "
                          "rollout.multi_turn.environment")
    if multi.environment_options and multi.environment is None:
        raise ConfigError("rollout.multi_turn.environment_options is set but rollout.multi_turn.environment is null; "
                          "name the environment or remove its options")
    twice = sorted({str(name) for name in multi.tools if multi.tools.count(name) > 1})
    if twice:
        raise ConfigError(f"rollout.multi_turn.tools = {multi.tools!r} offers {twice[0]!r} more than once; "
                          "list each tool once")
    for name in multi.tool_options:
        if name not in multi.tools:
            raise ConfigError(f"rollout.multi_turn.tool_options.{name} configures a tool that rollout.multi_turn.tools "
                              f"does not offer ({', '.join(map(str, multi.tools))}); add it to tools or remove the options")
    if cfg.rollout.partial.enabled:
        check_carried_conversations(cfg)


def check_carried_conversations(cfg: Any) -> None:
    """What multi-turn rows carried across steps (rollout.partial) cannot do yet (an environment
    that cannot save its episode is refused when the sampler builds one: SavedEnvironment)."""
    multi, partial = cfg.rollout.multi_turn, cfg.rollout.partial
    # Carried conversations continue by re-prefill (a kept cache would have to hold tool turns across rounds).
    if multi.kv_cache == "kept" or partial.kv_cache in ("within_step", "across_steps"):
        mode = "rollout.multi_turn.kv_cache = kept" if multi.kv_cache == "kept" else \
            f"rollout.partial.kv_cache = {partial.kv_cache}"
        raise ConfigError(f"{mode} with multi-turn partial rollouts: carried conversations continue by re-prefill; "
                          "set rollout.multi_turn.kv_cache=auto and rollout.partial.kv_cache=auto")
    for name in ("max_staleness", "budget_quantile"):
        if getattr(partial, name) is not None:
            raise ConfigError(f"rollout.partial.{name} = {getattr(partial, name)} with rollout.multi_turn.enabled: "
                              f"multi-turn rows are carried with a fixed budget and never restarted; set "
                              f"rollout.partial.{name}=null")

def check_tools(cfg: Any, registry: Any, plugin_options: Any) -> None:
    """Every offered tool exists in the registry and its options fit its plugin."""
    multi = cfg.rollout.multi_turn
    if not multi.enabled:
        return
    for name in multi.tools:
        try:
            spec = registry.tool(str(name))
        except PluginError as exc:
            raise ConfigError(f"rollout.multi_turn.tools: {exc}") from None
        plugin_options(spec.options, multi.tool_options.get(name, {}), f"rollout.multi_turn.tool_options.{name}")
    if multi.environment is not None:
        try:
            spec = registry.environment(str(multi.environment))
        except PluginError as exc:
            raise ConfigError(f"rollout.multi_turn.environment: {exc}") from None
        plugin_options(spec.options, multi.environment_options, "rollout.multi_turn.environment_options")
