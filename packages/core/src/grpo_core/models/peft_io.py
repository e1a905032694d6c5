"""PEFT adapter directories: adapter_config.json + adapter_model.safetensors, both ways.

PEFT names a LoRA tensor `base_model.model.model.layers.{N}.{self_attn|mlp}.{proj}.lora_A.weight`
with lora_A [r, fan_in] and lora_B [fan_out, r] (torch Linear layout); ours are stacked
over layers with head axes kept: a [L, in..., r], b [L, r, out...]. The conversion is a
transpose and a reshape, so PEFT -> ours -> PEFT is bitwise.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

import numpy as np
from safetensors.numpy import load_file, save_file

from grpo_core.models.lora import ALL_LINEAR, TARGET_PATHS, LoRASpec, layer_shapes

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# PEFT settings this format has no place for: refused on load unless at their default.
UNSUPPORTED = {"use_dora": False, "modules_to_save": None, "layers_to_transform": None, "rank_pattern": {},
               "alpha_pattern": {}, "bias": "none", "fan_in_fan_out": False}


def peft_name(layer: int, target: str, which: str) -> str:
    return f"base_model.model.model.layers.{layer}.{'.'.join(TARGET_PATHS[target])}.lora_{which}.weight"


def to_peft(arrays: dict[str, tuple[np.ndarray, np.ndarray]]) -> dict[str, np.ndarray]:
    """target -> (a [L, in..., r], b [L, r, out...]) to PEFT's per-layer tensors."""
    tensors = {}
    for target, (a, b) in arrays.items():
        rank = a.shape[-1]
        for layer in range(a.shape[0]):
            tensors[peft_name(layer, target, "A")] = np.ascontiguousarray(a[layer].reshape(-1, rank).T)
            tensors[peft_name(layer, target, "B")] = np.ascontiguousarray(b[layer].reshape(rank, -1).T)
    return tensors


def from_peft(tensors: dict[str, np.ndarray], spec: LoRASpec, cfg: Any) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """PEFT tensors -> target -> (a, b) stacked for `cfg` (a QwenConfig); a missing tensor or a
    shape that does not fit the model is a ValueError naming it."""
    shapes, arrays = layer_shapes(cfg), {}
    for target in spec.targets:
        in_shape, out_shape = shapes[target]
        wanted = {"A": (spec.rank, math.prod(in_shape)), "B": (math.prod(out_shape), spec.rank)}
        per_layer = {"A": [], "B": []}
        for layer in range(cfg.num_hidden_layers):
            for which in ("A", "B"):
                per_layer[which].append(_tensor(tensors, peft_name(layer, target, which), wanted[which]))
        a = np.stack([t.T.reshape(*in_shape, spec.rank) for t in per_layer["A"]])
        b = np.stack([t.T.reshape(spec.rank, *out_shape) for t in per_layer["B"]])
        arrays[target] = (a, b)
    extra = set(tensors) - {peft_name(l, t, w) for t in spec.targets for l in range(cfg.num_hidden_layers)
                            for w in ("A", "B")}
    if extra:
        raise ValueError(f"adapter tensor {sorted(extra)[0]} has no place in the model ({len(extra)} such)")
    return arrays


def _tensor(tensors: dict, name: str, shape: tuple[int, int]) -> np.ndarray:
    if name not in tensors:
        raise ValueError(f"adapter tensor {name} is missing")
    if tuple(tensors[name].shape) != shape:
        raise ValueError(f"adapter tensor {name} has shape {tuple(tensors[name].shape)}, the model needs {shape}")
    return tensors[name]


def save_peft(out_dir: str | os.PathLike, arrays: dict[str, tuple[np.ndarray, np.ndarray]], spec: LoRASpec,
              base_model: str | None) -> None:
    """Writes a directory `peft.PeftModel.from_pretrained(base, out_dir)` loads."""
    os.makedirs(out_dir, exist_ok=True)
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": spec.rank, "lora_alpha": spec.alpha,
              "use_rslora": spec.rslora, "lora_dropout": 0.0, "target_modules": list(spec.targets),
              "base_model_name_or_path": base_model, "inference_mode": True, "init_lora_weights": True,
              **UNSUPPORTED}
    with open(os.path.join(out_dir, ADAPTER_CONFIG), "w") as f:
        json.dump(config, f, indent=2)
    save_file(to_peft(arrays), os.path.join(out_dir, ADAPTER_WEIGHTS), metadata={"format": "pt"})


def read_peft_config(adapter_dir: str | os.PathLike) -> LoRASpec:
    """The LoRASpec of a PEFT adapter directory; a setting this format cannot hold is a ValueError."""
    with open(os.path.join(adapter_dir, ADAPTER_CONFIG)) as f:
        config = json.load(f)
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"peft_type {config['peft_type']!r} is not LORA")
    for key, default in UNSUPPORTED.items():
        if config.get(key) not in (default, None, [], {}):
            raise ValueError(f"{key} = {config[key]!r} is not supported (only {default!r})")
    targets = config["target_modules"]
    # PEFT may save full module paths (model.layers.0.self_attn.q_proj): the last name counts
    targets = [targets] if isinstance(targets, str) else sorted({t.rsplit(".", 1)[-1] for t in targets})
    if any(t != ALL_LINEAR and t not in TARGET_PATHS for t in targets):
        raise ValueError(f"target_modules {targets} name modules other than {', '.join(TARGET_PATHS)}")
    resolved = tuple(t for t in TARGET_PATHS if ALL_LINEAR in targets or t in targets)
    return LoRASpec(int(config["r"]), float(config["lora_alpha"]), resolved, bool(config.get("use_rslora", False)))


def load_peft(adapter_dir: str | os.PathLike, cfg: Any) -> tuple[LoRASpec, dict[str, tuple[np.ndarray, np.ndarray]]]:
    """(spec, target -> (a, b)) of a PEFT adapter directory, checked against the model config."""
    spec = read_peft_config(adapter_dir)
    return spec, from_peft(load_file(os.path.join(adapter_dir, ADAPTER_WEIGHTS)), spec, cfg)
