"""One table mapping HF checkpoint tensor names to model parameter paths, both ways.

Each row pairs an HF name template with our path template; `{layer}` and `{proj}`
placeholders are compiled into regexes for both directions. Our decoder-layer
parameters are stacked over layers, so `model.layers.3.mlp.up_proj.weight` is layer 3
of our `layers.mlp.up_proj.kernel`: the layer index travels next to the path. An HF name
with `{layer}` and `{expert}` (a MoE expert's weight) is the slice [layer, expert] of a
parameter stacked over layers and experts: its index is (layer, expert). The transform says how
the tensor is laid out: HF Linear weights are [out, in] while our kernels are
[in..., out...] with heads split out.
"""

from __future__ import annotations

import functools
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

_PLACEHOLDERS = {"layer": r"\d+", "expert": r"\d+", "qkv": "q|k|v", "qk": "q|k", "gate_up": "gate|up"}

# Placeholders that index the leading stacked axes of our parameter, outermost first.
INDEX_KEYS = ("layer", "expert")

# (HF name, our path, transform)
HF_TABLE: tuple[tuple[str, str, Transform], ...] = (
    ("model.embed_tokens.weight", "embed_tokens.embedding", Same()),
    ("model.norm.weight", "norm.scale", Same()),
    ("lm_head.weight", "lm_head.kernel", Linear()),
    ("model.layers.{layer}.input_layernorm.weight", "layers.input_layernorm.scale", Same()),
    ("model.layers.{layer}.post_attention_layernorm.weight", "layers.post_attention_layernorm.scale", Same()),
    ("model.layers.{layer}.self_attn.{qkv}_proj.weight", "layers.self_attn.{qkv}_proj.kernel", Linear()),
    ("model.layers.{layer}.self_attn.{qkv}_proj.bias", "layers.self_attn.{qkv}_proj.bias", Flat()),
    ("model.layers.{layer}.self_attn.o_proj.weight", "layers.self_attn.o_proj.kernel", Linear(n_in=2)),
    ("model.layers.{layer}.self_attn.o_proj.bias", "layers.self_attn.o_proj.bias", Same()),
    ("model.layers.{layer}.self_attn.{qk}_norm.weight", "layers.self_attn.{qk}_norm.scale", Same()),
    ("model.layers.{layer}.mlp.{gate_up}_proj.weight", "layers.mlp.{gate_up}_proj.kernel", Linear()),
    ("model.layers.{layer}.mlp.down_proj.weight", "layers.mlp.down_proj.kernel", Linear()),
)

# Tensors some checkpoints carry that the forward pass recomputes.
HF_IGNORED = (re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq"),)


def _compile(template: str) -> re.Pattern:
    pattern = re.escape(template)
    for name, alternatives in _PLACEHOLDERS.items():
        pattern = pattern.replace(re.escape("{" + name + "}"), f"(?P<{name}>{alternatives})")
    return re.compile(pattern + r"\Z")


@functools.cache
def _compiled(table: tuple) -> tuple[tuple, tuple]:
    """(HF pattern -> our template rows, our pattern -> HF template rows) of `table`."""
    return (tuple((_compile(hf), ours, t) for hf, ours, t in table),
            tuple((_compile(ours), hf, t) for hf, ours, t in table))


def hf_to_ours(hf_name: str, table: tuple | None = None) -> tuple[str, Transform, tuple[int, ...]] | None:
    """(our dotted path, transform, index into the parameter's stacked leading axes: () when it is
    not stacked, (layer,) or (layer, expert)) for an HF tensor name by `table` (a family's; None =
    HF_TABLE); None if it is not a parameter."""
    for pattern, template, transform in _compiled(table or HF_TABLE)[0]:
        match = pattern.match(hf_name)
        if match:
            groups = match.groupdict()
            index = tuple(int(groups.pop(key)) for key in INDEX_KEYS if key in groups)
            return template.format(**groups), transform, index
    return None


def is_stacked(path: str) -> bool:
    """Whether our parameter at `path` is stacked over decoder layers."""
    return path.startswith("layers.")


def _depth(hf_template: str) -> int:
    return sum("{" + key + "}" in hf_template for key in INDEX_KEYS)


def index_depth(path: str, table: tuple | None = None) -> int:
    """How many leading axes of our parameter `path` index separate HF tensors (0, 1 or 2)."""
    for pattern, template, _ in _compiled(table or HF_TABLE)[1]:
        if pattern.match(path):
            return _depth(template)
    raise KeyError(f"parameter {path!r} has no Hugging Face name in the table.")


def ours_to_hf(path: str, index: tuple[int, ...] = (), table: tuple | None = None) -> tuple[str, Transform]:
    """HF name and transform of our parameter `path` (its slice `index` when stacked) by `table`."""
    for pattern, template, transform in _compiled(table or HF_TABLE)[1]:
        match = pattern.match(path)
        if match and len(index) == _depth(template):
            return template.format(**dict(zip(INDEX_KEYS, index)), **match.groupdict()), transform
    raise KeyError(f"parameter {path!r} (index {index}) has no Hugging Face name in the table.")


@dataclass(frozen=True)
class CheckpointNames:
    """How one checkpoint's tensors are named: the HF table of the model's tensors (None = HF_TABLE),
    patterns of tensors not loaded (recomputed ones; an outer checkpoint's other parts) and names
    the caller reads apart."""

    table: tuple | None = None
    not_loaded: tuple[re.Pattern, ...] = HF_IGNORED
    skip: frozenset[str] = frozenset()

    def skipped(self, hf_name: str) -> bool:
        return hf_name in self.skip or any(p.match(hf_name) for p in self.not_loaded)
