"""The field helper of the run configuration's dataclasses (`grpo_core.config`) and the limits
its settings share."""

from __future__ import annotations

from dataclasses import field
from typing import Any

Number = float | int
# Projections LoRA can adapt (HF module names), and the name of all of them.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "all-linear")
# JAX's default (32-bit) PRNG keys keep the low 32 bits of a seed: 2**32 would repeat seed 0.
JAX_SEED_MAX = 2**32 - 1
NUMPY_SEED_MAX = 2**64 - 1


def setting(default: Any, doc: str, *, ge: Number | None = None, gt: Number | None = None,
            le: Number | None = None, lt: Number | None = None) -> Any:
    """A config field with its documentation and numeric range."""
    meta = {"doc": doc, "ge": ge, "gt": gt, "le": le, "lt": lt}
    if isinstance(default, (dict, list)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)
