"""Strict YAML -> RunConfig loading, dotted overrides, plugin-option validation (the YAML
reading itself is `grpo_core.config_yaml`).

Nothing here touches JAX devices: a bad config fails in milliseconds.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import types
import typing
from pathlib import Path
from typing import Any, Iterable, Literal, Optional, Union

import yaml

from grpo_core.advantage_records import AdvantageSetup
from grpo_core.config import RunConfig
from grpo_core.config_checks import check_eval_k, check_eval_reward, finite, validate_cross_fields
from grpo_core.config_notes import config_notes
from grpo_core.config_yaml import parse_yaml, read_yaml
from grpo_core.config_teacher import check_teacher_section
from grpo_core.errors import ConfigError, PluginError
from grpo_core.model_families import publish_registry
from grpo_core.multi_turn_checks import check_tools

EXPLICIT_MESH = re.compile(r"^\s*-?\d+\s*,\s*-?\d+\s*,\s*-?\d+\s*$")


def _override_value(key: str, raw: str) -> Any:
    """A YAML scalar or flow mapping; `~` and `~/...` are the home directory (a path), not null."""
    if raw.strip().startswith("~"):
        return raw.strip()
    try:
        return parse_yaml(raw) if raw.strip() else None
    except yaml.YAMLError:
        raise ConfigError(f"override {key}: value {raw!r} is not a valid YAML scalar; quote it") from None


def section_type(parts: list[str]) -> Optional[type]:
    """The config dataclass that the dotted key `parts` names (RunConfig for []), else None."""
    cls: Any = RunConfig
    for part in parts:
        hint = typing.get_type_hints(cls).get(part) if dataclasses.is_dataclass(cls) else None
        if hint is None or not dataclasses.is_dataclass(hint):
            return None
        cls = hint
    return cls


def apply_override(tree: dict, override: str) -> None:
    """Applies one `section.key=value` override in place. A whole section given a mapping
    (`rollout={n: 4}`) is merged key by key, as `rollout.n=4` would be; `rollout={}` changes nothing."""
    key, sep, raw = override.partition("=")
    key = key.strip()
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {override!r} is not of the form section.key=value "
                          "(example: train.lr=1e-6)")
    _set(tree, key.split("."), _override_value(key, raw), key)


def _set(tree: dict, parts: list[str], value: Any, key: str) -> None:
    if section_type(parts) is not None:
        if not isinstance(value, dict):
            shown = "null" if value is None else repr(value)
            raise ConfigError(f"override {key}={shown}: {key} is a section, and an override merges into it; "
                              f"set its keys ({key}.<key>=value) or give a mapping ({key}={{key: value}})")
        for name, inner in value.items():
            _set(tree, [*parts, str(name)], inner, f"{key}.{name}")
        return
    *parents, leaf = parts
    node = tree
    for depth, part in enumerate(parents):
        if node.get(part) is None:  # absent, or a section left empty (null) in the file
            node[part] = {}
        child = node[part]
        if not isinstance(child, dict):
            where = ".".join(parents[: depth + 1])
            raise ConfigError(f"override {key}: {where} is a value ({child!r}), not a section")
        node = child
    node[leaf] = value


def _describe(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(tp))
    return {type(None): "null", int: "an integer", float: "a finite number", str: "a string",
            bool: "true/false", dict: "a mapping", list: "a list"}.get(tp, getattr(tp, "__name__", str(tp)))


def _coerce(tp: Any, value: Any) -> tuple[bool, Any]:
    """(ok, converted value) for `value` against type annotation `tp`."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        return any(value == a and type(value) is type(a) for a in typing.get_args(tp)), value
    if origin in (Union, types.UnionType):
        for arg in typing.get_args(tp):
            ok, converted = _coerce(arg, value)
            if ok:
                return True, converted
        return False, value
    if tp is type(None):
        return value is None, value
    if tp is float:  # every float setting means a finite number: NaN and inf are refused
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and finite(value)
        return ok, float(value) if ok else value
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if tp in (str, bool, dict, list):
        return isinstance(value, tp), value
    if tp is Any:
        return True, value
    return isinstance(value, tp), value


def _check_range(key: str, value: Any, meta: typing.Mapping) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return
    bounds = [("ge", ">=", lambda v, b: v >= b), ("gt", ">", lambda v, b: v > b),
              ("le", "<=", lambda v, b: v <= b), ("lt", "<", lambda v, b: v < b)]
    for name, symbol, holds in bounds:
        bound = meta.get(name)
        if bound is not None and not holds(value, bound):
            allowed = " and ".join(f"{s} {meta[n]}" for n, s, _ in bounds if meta.get(n) is not None)
            raise ConfigError(f"{key} = {value!r} is out of range: must be {allowed}")


def _unknown_key(key: str, valid: Iterable[str], prefix: str) -> ConfigError:
    full = prefix + key
    close = difflib.get_close_matches(key, list(valid), n=1, cutoff=0.5)
    keys = ", ".join(sorted(valid)) or "none (it takes no options); remove the key"
    hint = f"; did you mean {prefix + close[0]}?" if close else f"; valid keys: {keys}"
    return ConfigError(f"unknown config key {full}{hint}")


def build_dataclass(cls: type, data: Any, prefix: str = "") -> Any:
    """An instance of dataclass `cls` from a mapping, checking keys, types and ranges."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        where = prefix.rstrip(".") or "the config"
        raise ConfigError(f"{where} must be a mapping, got {type(data).__name__} {data!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in data:
        if key not in fields:
            raise _unknown_key(str(key), fields, prefix)
    hints = typing.get_type_hints(cls)
    values = {name: _field_value(hints[name], data[name], prefix + name, fields[name].metadata)
              for name in data}
    return cls(**values)


def _check_text(key: str, value: Any) -> None:
    """Every string of a value is real Unicode: YAML's "\\ud800" escapes make lone surrogates,
    which no tokenizer, file system or log can take."""
    texts = [value] if isinstance(value, str) else []
    if isinstance(value, dict):
        texts = [str(k) for k in value] + [v for v in value.values() if isinstance(v, str)]
    elif isinstance(value, list):
        texts = [v for v in value if isinstance(v, str)]
    for text in texts:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise ConfigError(f"{key} = {text!r} holds a lone surrogate (a \\ud800-\\udfff escape), which is "
                              "not text; write the character itself or drop the escape") from None


def _field_value(tp: Any, value: Any, key: str, meta: typing.Mapping) -> Any:
    if dataclasses.is_dataclass(tp):
        return build_dataclass(tp, value, key + ".")
    _check_text(key, value)
    ok, converted = _coerce(tp, value)
    if not ok:
        raise ConfigError(f"{key} = {value!r} has the wrong type: expected {_describe(tp)}")
    _check_range(key, converted, meta)
    return converted


def plugin_options(options_cls: type, data: Any, prefix: str) -> Any:
    """Validates a plugin's `options:` mapping against the plugin's options dataclass."""
    try:
        return build_dataclass(options_cls, data, prefix + ".")
    except TypeError as exc:  # a required option without a default was left out
        raise ConfigError(f"{prefix}: {exc}") from None
    except ValueError as exc:  # an options dataclass's own __post_init__ check
        raise ConfigError(f"{prefix}: {exc}") from None


def _mesh_plugin_name(strategy: str) -> str:
    return "explicit" if EXPLICIT_MESH.match(strategy) else strategy


def validate_plugins(cfg: RunConfig, registry: Any) -> None:
    """Every plugin name exists and every `options:` block fits its plugin."""
    selected = [("loss", cfg.loss.impl, cfg.loss.options, "loss.options"),
                ("rollout", cfg.rollout.backend, cfg.rollout.options, "rollout.options"),
                ("task", cfg.task.name, cfg.task.options, "task.options"),
                ("mesh", _mesh_plugin_name(cfg.mesh.strategy), cfg.mesh.options, "mesh.options"),
                ("advantage", cfg.loss.advantage_estimator, cfg.loss.advantage_options, "loss.advantage_options")]
    selected += [("reward", name, cfg.task.reward_options.get(name, {}), f"task.reward_options.{name}")
                 for name in cfg.task.rewards]
    for kind, name, options, where in selected:
        try:
            spec = registry.get(kind, name)
        except PluginError as exc:
            raise ConfigError(f"{_name_key(kind)}: {exc}") from None
        checked = plugin_options(spec.options, options, where)
        if kind == "loss":
            _check_entropy_provided(cfg, spec)
        if kind == "advantage":
            _check_estimator(cfg, spec, checked)
        if kind == "rollout":
            _check_decode_settings(cfg.rollout, spec, checked)
    check_tools(cfg, registry, plugin_options)


def _check_entropy_provided(cfg: RunConfig, spec: Any) -> None:
    if cfg.loss.top_entropy_quantile < 1.0 and not getattr(spec, "provides_entropy", True):
        raise ConfigError(f"loss.top_entropy_quantile = {cfg.loss.top_entropy_quantile} selects tokens by entropy, "
                          f"but loss.impl = {cfg.loss.impl!r} cannot provide the entropy; use loss.impl=fused "
                          "(or jax, pallas) or set loss.top_entropy_quantile=1.0")


# rollout key -> (its default, the backend method that serves another value, what that method does)
DECODE_SETTINGS = {"quantize": ("none", "quantize_with", "quantize its weights"),
                   "kv_cache_dtype": ("auto", "kv_cache_with", "store an 8-bit KV cache")}


def _check_decode_settings(rollout: Any, spec: Any, options: Any) -> None:
    """The backend samples with rollout.quantize and rollout.kv_cache_dtype in its configured layout
    (`quantize_with`, `kv_cache_with`), or the config is refused in one line."""
    for key, (default, method, what) in DECODE_SETTINGS.items():
        value = getattr(rollout, key)
        if value == default:
            continue
        backend = spec.factory(options)
        if not hasattr(backend, method):
            raise ConfigError(f"rollout.{key} = {value}: rollout.backend = {spec.name!r} cannot {what}; "
                              f"set rollout.{key}={default} or rollout.backend=jax")
        try:
            getattr(backend, method)(value)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None


def _name_key(kind: str) -> str:
    return {"loss": "loss.impl", "rollout": "rollout.backend", "task": "task.name", "mesh": "mesh.strategy",
            "advantage": "loss.advantage_estimator"}.get(kind, "task.rewards")


def _check_estimator(cfg: RunConfig, spec: Any, options: Any) -> None:
    """The estimator refuses, when the config loads, a setup it cannot serve (e.g. rloo with n = 1)."""
    try:
        spec.factory(options, setup=AdvantageSetup.from_config(cfg))
    except ValueError as exc:
        raise ConfigError(f"loss.advantage_estimator = {spec.name!r}: {exc}") from None


def resolve_run_dir(cfg: RunConfig) -> RunConfig:
    """logging.dir with `~` expanded and made absolute, so checkpoints (orbax wants absolute
    paths) and every later message use one unambiguous directory."""
    raw = cfg.logging.dir
    if not raw.strip():
        raise ConfigError(f"logging.dir = {raw!r} is empty: set it to the run directory, e.g. logging.dir=runs/my-run")
    absolute = os.path.abspath(os.path.expanduser(raw))
    return dataclasses.replace(cfg, logging=dataclasses.replace(cfg.logging, dir=absolute))


def resolve_defaults(cfg: RunConfig) -> RunConfig:
    """Every "null = same as X" setting filled in with X, so the loaded config (and
    `--print-config`, and the saved config.yaml) shows what the run uses."""
    replace = dataclasses.replace
    return replace(
        cfg,
        model=replace(cfg.model, tokenizer=cfg.model.tokenizer or cfg.model.path),
        train=replace(cfg.train, moment_dtype=cfg.train.moment_dtype or trained_param_dtype(cfg.model)),
        loss=replace(cfg.loss, max_completion_length=cfg.loss.max_completion_length or cfg.rollout.max_new_tokens),
        eval=replace(cfg.eval, max_new_tokens=cfg.eval.max_new_tokens or cfg.rollout.max_new_tokens),
        teacher=replace(cfg.teacher, dtype=cfg.teacher.dtype or (cfg.model.dtype if cfg.teacher.path else None)),
        rollout=replace(cfg.rollout, partial=replace(
            cfg.rollout.partial, budget=cfg.rollout.partial.budget or -(-cfg.rollout.max_new_tokens // 4))))


def trained_param_dtype(model: Any) -> str:
    """Storage dtype of what the optimizer updates: LoRA adapters train in float32."""
    return "float32" if model.lora.rank is not None else model.param_dtype


def _home(path: Optional[str]) -> Optional[str]:
    return os.path.expanduser(path) if path and path.startswith("~") else path


def expand_home(cfg: RunConfig) -> RunConfig:
    """`~` at the start of model.path / model.tokenizer / model.lora.init_from / teacher.path is the home directory
    (a Hub id never starts with it)."""
    lora = dataclasses.replace(cfg.model.lora, init_from=_home(cfg.model.lora.init_from))
    model = dataclasses.replace(cfg.model, path=_home(cfg.model.path), tokenizer=_home(cfg.model.tokenizer),
                                lora=lora)
    return dataclasses.replace(cfg, model=model, teacher=dataclasses.replace(cfg.teacher, path=_home(cfg.teacher.path)))


def load_config(path: str | Path | None = None, overrides: Iterable[str] = (), registry: Any = None) -> RunConfig:
    """The validated RunConfig from a YAML file (None = all defaults) plus overrides."""
    tree = read_yaml(path) if path is not None else {}
    for override in overrides:
        apply_override(tree, override)
    check_teacher_section(tree)
    if registry is not None:
        publish_registry(registry)  # the model families it holds resolve from config.json model_type
    cfg = resolve_defaults(expand_home(resolve_run_dir(build_dataclass(RunConfig, tree))))
    validate_cross_fields(cfg)
    if registry is not None:
        validate_plugins(cfg, registry)
    check_eval_k(cfg.eval)
    check_eval_reward(cfg)  # after the plugins: a misspelt reward is reported as unknown first
    config_notes(cfg)
    return cfg


def config_to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)


def config_to_yaml(cfg: Any) -> str:
    return yaml.safe_dump(config_to_dict(cfg), sort_keys=False, default_flow_style=False)
