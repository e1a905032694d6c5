"""Which settings a resumed run may change: a checkpoint's saved config against the current one,
compared key by key; a difference in a setting that alters the model, the data order or the math
of an update refuses the resume in one line naming each key with both values."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from grpo_core.errors import UserError

# Settings that may change when a run resumes: they alter neither the model, the data
# order nor the math of an update (length of the run, memory/speed knobs, logging).
MAY_CHANGE_ON_RESUME = ("train.steps", "train.micro_batch_size_per_device", "model.remat", "model.scan_layers",
                        "loss.impl",
                        "loss.options", "mesh", "eval", "logging", "checkpoint")
_ABSENT = object()  # a key one of two configs lacks


def flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}, "c": {}} -> {"a.b": 1}: one entry per setting."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _may_change(key: str) -> bool:
    return any(key == allowed or key.startswith(allowed + ".") for allowed in MAY_CHANGE_ON_RESUME)


def config_differences(saved: dict, current: dict) -> dict[str, tuple[Any, Any]]:
    """{dotted key: (saved value, current value)} for the keys a resume may not change."""
    old, new = flatten(saved), flatten(current)
    keys = sorted(set(old) | set(new))
    return {k: (old.get(k, _ABSENT), new.get(k, _ABSENT)) for k in keys
            if not _may_change(k) and old.get(k, _ABSENT) != new.get(k, _ABSENT)}


def _shown(value: Any) -> str:
    return "unset" if value is _ABSENT else json.dumps(value)


def check_compatible(saved: dict, current: dict, where: Path) -> None:
    differences = config_differences(saved, current)
    if differences:
        detail = ", ".join(f"{k} (saved {_shown(a)}, now {_shown(b)})" for k, (a, b) in differences.items())
        raise UserError(f"cannot resume from {where}: the config differs in {detail}; use the saved values, "
                        "or set logging.dir to a new directory to start a fresh run")
