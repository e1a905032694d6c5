"""Model families: what one decoder family (an HF `model_type`) changes in the shared decoder.

Every family runs the shared decoder of `grpo_core.models` (RMSNorm, grouped-query attention
with rotary embeddings, SwiGLU MLP, optional tied head; its parameter shapes and logical axes,
init, cache-free and KV-cached forward, decode step, and the FLOP/byte counts the planner
derives from `QwenConfig`). A family is written as its difference from that block: the
methods of `ModelFamily` below, whose defaults are the plain decoder (Llama's layout without
biases). `model_type ==` appears in no other module: a config asks its family.

Families register through the `grpo_model_families` hook (entry-point group `grpo`) and are
selected by `model_type` (or `architectures`) in `model.architecture` or a checkpoint's
`config.json`. The built-in families and those of the registry a run config is checked against
are published here, so a config built anywhere in the process resolves them; an unknown name
is looked up in the installed plugins, then refused. A family may also read checkpoints that hold
its model as the language model of a larger one (`OuterCheckpoint`: Gemma 3's multimodal
`gemma3`), unwrapping their config.json.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import jax.numpy as jnp

from grpo_core.errors import PluginError
from grpo_core.registry import Registry, default_registry

_PUBLISHED: dict[str, ModelFamily] = {}


def unsupported(key: str, value: Any, supported: str) -> ValueError:
    return ValueError(f"config.json: {key}={value!r} is not supported; supported: {supported}.")


@dataclass(frozen=True)
class OuterCheckpoint:
    """A checkpoint holding a family's model as the language model of a larger one (Gemma 3's
    multimodal Gemma3ForConditionalGeneration), named by config.json's `model_type` (without one, by
    `architectures`). hf_table: HF name rows of the language model's tensors in it (the first row
    of a parameter names it in errors); not_loaded: patterns of its other parts' tensors (a vision
    tower), skipped on load."""

    model_type: str
    architecture: str
    hf_table: tuple
    not_loaded: tuple[re.Pattern, ...] = ()


class ModelFamily:
    """One HF `model_type`, as its difference from the shared decoder.

    name:           the HF `model_type` ("llama"); also the `ModelFamilySpec` name.
    architecture:   the HF class in config.json `architectures` ("LlamaForCausalLM").
    attention_bias: the default of `QwenConfig.attention_bias` (q/k/v projection biases).
    writes_head_dim: config.json always carries `head_dim` (else only when it is not hidden / heads).
    hf_table:       HF tensor name <-> parameter path rows for load and export; None = the shared
                    `grpo_core.models.hf_names.HF_TABLE` (parameters a config lacks are simply absent).
    sparse_mlp:     the MLP routes tokens to experts (`QwenConfig.num_experts` may be non-zero).
    outer:          checkpoints holding this family's model inside a larger one (`unwrap_hf` reads
                    their config.json); the family's export writes its own model only.
    """

    name: str = ""
    architecture: str = ""
    attention_bias: bool = False
    writes_head_dim: bool = False
    hf_table: tuple | None = None
    activations: tuple[str, ...] = ("silu",)  # accepted `hidden_act` values (grpo_core.models.layers.ACTIVATIONS)
    option_keys: frozenset[str] = frozenset()  # config.json keys kept in `QwenConfig.family_options`
    sparse_mlp: bool = False  # the MLP routes tokens to experts (qwen3_moe)
    outer: tuple[OuterCheckpoint, ...] = ()

    def validate(self, cfg: Any) -> None:
        """Raise ValueError (one line: key, value seen, what is supported) for a config this family cannot run."""

    def qk_norm(self, cfg: Any) -> bool:
        """Per-head RMSNorm of queries and keys before RoPE."""
        return False

    def o_bias(self, cfg: Any) -> bool:
        """A bias on the attention output projection."""
        return False

    def rope_scaling(self, block: dict | None) -> tuple | None:
        """The HF `rope_scaling` mapping (rope_theta removed) as sorted (key, value) pairs, or None for
        plain RoPE; a scaling this family does not implement is refused."""
        kind = rope_type(block)
        if kind != "default":
            raise unsupported("rope_scaling.rope_type", kind, "'default' RoPE (no scaling)")
        return None

    def rope_frequencies(self, cfg: Any) -> jnp.ndarray:
        """Inverse frequencies [head_dim / 2] (f32) of the rotary embedding."""
        return default_frequencies(cfg.head_dim, cfg.rope_theta)

    def mlp(self, cfg: Any, *, dtype: Any, rngs: Any) -> Any:
        """The MLP block of a decoder layer ([B, T, H] -> [B, T, H]), or None for the shared SwiGLU
        MLP of `intermediate_size`."""
        return None

    def mlp_matmul_params(self, cfg: Any) -> int:
        """Weights of one layer's MLP that multiply each token (the planner's FLOP count)."""
        return 3 * cfg.hidden_size * cfg.intermediate_size

    def hf_extras(self, cfg: Any) -> dict[str, Any]:
        """config.json keys this family writes beyond the shared ones."""
        return {"attention_bias": cfg.attention_bias, "mlp_bias": False}

    # ---- config.json keys of this family only ------------------------------------------
    def unwrap_hf(self, d: dict[str, Any]) -> dict[str, Any]:
        """The language model's own config.json inside `d`, the config.json of one of `outer`."""
        raise NotImplementedError(f"model family {self.name!r} declares outer checkpoints but no unwrap_hf")

    def read_hf(self, d: dict[str, Any]) -> None:
        """Rewrite a parsed config.json in place before the shared reader sees it (e.g. move this
        family's own keys into d['family_options'], refuse what it does not implement)."""

    def options(self, given: dict[str, Any], cfg: Any) -> tuple:
        """`QwenConfig.family_options` completed and checked, as sorted (key, value) pairs."""
        if given:
            raise unsupported("family_options", sorted(given), f"none for {self.name}")
        return ()

    # ---- the decoder's hooks (defaults: the plain pre-norm decoder) -----------------------
    def norm_adds_one(self, cfg: Any) -> bool:
        """RMSNorm scales by (1 + weight), computed in f32, weights initialised at 0 (Gemma)."""
        return False

    def post_norms(self, cfg: Any) -> bool:
        """Four norms per layer: attention and MLP outputs are normed too before the residual
        add (post_attention_layernorm then norms the attention output, pre_feedforward_layernorm
        the MLP input, post_feedforward_layernorm its output)."""
        return False

    def embedding_scale(self, cfg: Any) -> float | None:
        """A factor on the token embeddings (in the model dtype), None for none."""
        return None

    def attention_scale(self, cfg: Any) -> float:
        """The factor on q.k scores."""
        return cfg.head_dim ** -0.5

    def sliding_windows(self, cfg: Any) -> tuple[int, ...] | None:
        """Per layer: the sliding window (a key is visible iff query slot - key slot < window),
        0 for a global layer; None when every layer is global."""
        return None

    def sliding_rope_frequencies(self, cfg: Any) -> jnp.ndarray:
        """Inverse RoPE frequencies of the sliding-window layers."""
        return self.rope_frequencies(cfg)

    def tiny_changes(self) -> dict[str, Any]:
        """`QwenConfig.tiny` changes that give this family its distinguishing shape."""
        return {}


def rope_type(block: dict | None) -> str:
    """The scaling kind of an HF `rope_scaling` block (`rope_type`, older configs `type`); "default" for none."""
    block = block or {}
    return block.get("rope_type", block.get("type", "default"))


def default_frequencies(head_dim: int, theta: float) -> jnp.ndarray:
    exponents = jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim
    return 1.0 / (jnp.float32(theta) ** exponents)


def publish(families: list[ModelFamily]) -> None:
    """Make `families` resolvable by name in this process."""
    for family in families:
        _PUBLISHED[family.name] = family


def publish_registry(registry: Registry) -> None:
    """Publish every family `registry` holds (its `grpo_model_families` hooks)."""
    for item in registry.entries("model_family"):
        family = item.spec.factory(item.spec.options())
        if not isinstance(family, ModelFamily) or family.name != item.spec.name:
            raise PluginError(f"model family {item.spec.name!r} of plugin {item.plugin!r} built {family!r}; expected "
                              f"a grpo_core.model_families.ModelFamily named {item.spec.name!r}")
        publish([family])


def published_names() -> list[str]:
    return sorted(_PUBLISHED)


def family_named(name: str) -> ModelFamily:
    """The family of HF `model_type` `name`; ValueError naming the installed ones when none is."""
    if name not in _PUBLISHED:
        publish_registry(default_registry())
    if name not in _PUBLISHED:
        raise unsupported("model_type", name, " | ".join(published_names()) + " (the installed model families)")
    return _PUBLISHED[name]


def family_of_hf_dict(d: dict[str, Any]) -> ModelFamily:
    """The family a config.json names: its `model_type`, else its `architectures`."""
    if d.get("model_type"):
        return family_named(d["model_type"])
    publish_registry(default_registry())
    names = list(d.get("architectures") or [])
    for family in _PUBLISHED.values():
        if family.architecture in names:
            return family
    supported = " | ".join(sorted(f.architecture for f in _PUBLISHED.values()))
    raise unsupported("architectures", names, supported + " (or give model_type)")


def outer_checkpoint_of(d: dict[str, Any]) -> tuple[ModelFamily, OuterCheckpoint] | None:
    """The family and `OuterCheckpoint` config.json `d` names, None when it names none."""
    found = _outer_named(d)
    if found is None and d.get("model_type") not in _PUBLISHED:
        publish_registry(default_registry())
        found = _outer_named(d)
    return found


def _outer_named(d: dict[str, Any]) -> tuple[ModelFamily, OuterCheckpoint] | None:
    kind, names = d.get("model_type"), list(d.get("architectures") or [])
    for family in _PUBLISHED.values():
        for outer in family.outer:
            if (kind == outer.model_type) if kind else (outer.architecture in names):
                return family, outer
    return None


def language_model_hf_dict(d: dict[str, Any]) -> tuple[ModelFamily, dict[str, Any]]:
    """The family of config.json `d` and its language model's own config.json: an outer checkpoint's,
    unwrapped by its family; `d` itself for a family's own model. Any other multimodal config (one
    with a text_config or vision_config) is refused in one line."""
    found = outer_checkpoint_of(d)
    if found is not None:
        return found[0], found[0].unwrap_hf(d)
    parts = [key for key in ("text_config", "vision_config") if key in d]
    if parts:
        outers = " | ".join(sorted(f"{o.model_type} ({o.architecture})" for f in _PUBLISHED.values() for o in f.outer))
        raise ValueError(f"config.json: model_type={d.get('model_type')!r} (architectures "
                         f"{list(d.get('architectures') or [])}) is a multimodal checkpoint ({' and '.join(parts)}) "
                         f"that no installed model family reads; supported: the language model of {outers}, "
                         f"or a text model's own config.json (model_type {' | '.join(published_names())}).")
    return family_of_hf_dict(d), d
