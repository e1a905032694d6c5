"""One table mapping HF checkpoint tensor names to model parameter paths, both ways.

Each row pairs an HF name template with our path template; `{layer}` and `{proj}`
placeholders are compiled into regexes for both directions. The transform says how
the tensor is laid out: HF Linear weights are [out, in] while our kernels are
[in..., out...] with heads split out.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Same:
    """Identical layout (embeddings, norm scales)."""

    def to_ours(self, w: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        return w

    def to_hf(self, w: np.ndarray) -> np.ndarray:
        return w


@dataclass(frozen=True)
class Flat:
    """HF 1-D bias; ours keeps the head axes ([N, D] or [KV, D])."""

    def to_ours(self, w: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        return w.reshape(shape)

    def to_hf(self, w: np.ndarray) -> np.ndarray:
        return w.reshape(-1)


@dataclass(frozen=True)
class Linear:
    """HF [out, in] weight; ours [in..., out...] where the first `n_in` axes are inputs."""

    n_in: int = 1

    def to_ours(self, w: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        return np.ascontiguousarray(w.T).reshape(shape)

    def to_hf(self, w: np.ndarray) -> np.ndarray:
        fan_in = math.prod(w.shape[: self.n_in])
        return np.ascontiguousarray(w.reshape(fan_in, -1).T)


Transform = Same | Flat | Linear

_PLACEHOLDERS = {"layer": r"\d+", "qkv": "q|k|v", "qk": "q|k", "gate_up": "gate|up"}

# (HF name, our path, transform)
HF_TABLE: tuple[tuple[str, str, Transform], ...] = (
    ("model.embed_tokens.weight", "embed_tokens.embedding", Same()),
    ("model.norm.weight", "norm.scale", Same()),
    ("lm_head.weight", "lm_head.kernel", Linear()),
    ("model.layers.{layer}.input_layernorm.weight", "layers.{layer}.input_layernorm.scale", Same()),
    ("model.layers.{layer}.post_attention_layernorm.weight", "layers.{layer}.post_attention_layernorm.scale", Same()),
    ("model.layers.{layer}.self_attn.{qkv}_proj.weight", "layers.{layer}.self_attn.{qkv}_proj.kernel", Linear()),
    ("model.layers.{layer}.self_attn.{qkv}_proj.bias", "layers.{layer}.self_attn.{qkv}_proj.bias", Flat()),
    ("model.layers.{layer}.self_attn.o_proj.weight", "layers.{layer}.self_attn.o_proj.kernel", Linear(n_in=2)),
    ("model.layers.{layer}.self_attn.o_proj.bias", "layers.{layer}.self_attn.o_proj.bias", Same()),
    ("model.layers.{layer}.self_attn.{qk}_norm.weight", "layers.{layer}.self_attn.{qk}_norm.scale", Same()),
    ("model.layers.{layer}.mlp.{gate_up}_proj.weight", "layers.{layer}.mlp.{gate_up}_proj.kernel", Linear()),
    ("model.layers.{layer}.mlp.down_proj.weight", "layers.{layer}.mlp.down_proj.kernel", Linear()),
)

# Tensors some checkpoints carry that the forward pass recomputes.
HF_IGNORED = (re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq"),)


def _compile(template: str) -> re.Pattern:
    pattern = re.escape(template)
    for name, alternatives in _PLACEHOLDERS.items():
        pattern = pattern.replace(re.escape("{" + name + "}"), f"(?P<{name}>{alternatives})")
    return re.compile(pattern + r"\Z")


_FORWARD = tuple((_compile(hf), ours, t) for hf, ours, t in HF_TABLE)
_BACKWARD = tuple((_compile(ours), hf, t) for hf, ours, t in HF_TABLE)


def _lookup(name: str, table) -> tuple[str, Transform] | None:
    for pattern, template, transform in table:
        match = pattern.match(name)
        if match:
            return template.format(**match.groupdict()), transform
    return None


def hf_to_ours(hf_name: str) -> tuple[str, Transform] | None:
    """(our dotted path, transform) for an HF tensor name; None if it is not a parameter."""
    return _lookup(hf_name, _FORWARD)


def ours_to_hf(path: str) -> tuple[str, Transform]:
    found = _lookup(path, _BACKWARD)
    if found is None:
        raise KeyError(f"parameter {path!r} has no Hugging Face name in HF_TABLE.")
    return found


def is_ignored(hf_name: str) -> bool:
    return any(p.match(hf_name) for p in HF_IGNORED)
