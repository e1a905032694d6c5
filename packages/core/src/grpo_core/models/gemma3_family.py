"""The Gemma 3 text family (`gemma3_text`, `Gemma3ForCausalLM`), as its difference from the
shared decoder (read from transformers' `modeling_gemma3.py` and Google's Gemma 3 report):

- layers of two kinds (`layer_types`, else every `sliding_window_pattern`-th layer global,
  5 sliding : 1 global in the released models): sliding layers see the last `sliding_window`
  slots (query slot - key slot < window) and rotate with `rope_local_base_freq`, global layers
  see every earlier slot and rotate with `rope_theta` and its `rope_scaling` (linear in 4B+);
- four RMSNorms per layer (the attention and MLP outputs are normed too), all of the form
  x * (1 + weight) computed in f32, weights initialised at 0; per-head q/k norms of that form;
- embeddings times sqrt(hidden_size), the factor rounded to the model dtype first;
- GeGLU MLP (`hidden_activation: gelu_pytorch_tanh`), tied head;
- attention scores scaled by query_pre_attn_scalar ** -0.5 instead of head_dim ** -0.5.

Not implemented, refused in one line: logit soft-capping (final or attention; null in the
released Gemma 3 configs), bidirectional attention, attention biases, other rope scalings.

The multimodal 4B/12B/27B checkpoints (`gemma3`, `Gemma3ForConditionalGeneration`) are read as
their language model: config.json's `text_config` and the `language_model` tensors; the vision
tower and projector are not loaded, and export writes a text-only `Gemma3ForCausalLM`.
"""

from __future__ import annotations

import re
from typing import Any

import jax.numpy as jnp

from grpo_core.model_families import ModelFamily, OuterCheckpoint, default_frequencies, rope_type, unsupported
from grpo_core.models.hf_names import HF_TABLE, Same

SLIDING, GLOBAL = "sliding_attention", "full_attention"
# Gemma3TextConfig defaults.
DEFAULTS = {"sliding_window": 4096, "rope_local_base_freq": 10_000.0, "query_pre_attn_scalar": 256,
            "sliding_window_pattern": 6}
_REFUSED_IF_SET = ("final_logit_softcapping", "attn_logit_softcapping", "use_bidirectional_attention")
# Keys of older Gemma 3 configs that do not change the forward pass.
_IGNORED = ("cache_implementation", "attn_implementation", "_sliding_window_pattern")

GEMMA3_TABLE = (
    *HF_TABLE,
    ("model.layers.{layer}.pre_feedforward_layernorm.weight", "layers.pre_feedforward_layernorm.scale", Same()),
    ("model.layers.{layer}.post_feedforward_layernorm.weight", "layers.post_feedforward_layernorm.scale", Same()),
)

# Gemma3TextConfig's defaults (the same from transformers 4.50 to 5.x) where this reader's own differ:
# a multimodal config.json's text_config omits keys equal to them. Its other defaults (rms_norm_eps,
# both rope thetas, sliding_window, query_pre_attn_scalar, the 5:1 pattern, the activation, the tied
# head, no biases) are this reader's already.
TEXT_CONFIG_DEFAULTS = {"vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
                        "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
                        "max_position_embeddings": 131_072, "bos_token_id": 2, "eos_token_id": 1}
# The outer config's own token ids win over text_config's, as in transformers' generation config
# (gemma-3-4b-it: eos [1, 106] outside; transformers 5 writes text_config's default 1 inside).
_OUTER_TOKEN_IDS = ("bos_token_id", "eos_token_id")
_DTYPE_KEYS = ("torch_dtype", "dtype")

# The language model's HF name prefixes in a Gemma3ForConditionalGeneration checkpoint, per layout.
_MULTIMODAL_LAYOUTS = (
    # transformers 4.50-4.5x files; 5.x save_pretrained converts back to this layout
    (("model.", "language_model.model."), ("lm_head.", "language_model.lm_head.")),
    # transformers 5.x module names (save_pretrained(save_original_format=False))
    (("model.", "model.language_model."), ("lm_head.", "lm_head.")),
)


def _renamed(hf_name: str, prefixes: tuple) -> str:
    old, new = next((old, new) for old, new in prefixes if hf_name.startswith(old))
    return new + hf_name.removeprefix(old)


GEMMA3_MULTIMODAL = OuterCheckpoint(
    model_type="gemma3", architecture="Gemma3ForConditionalGeneration",
    hf_table=tuple((_renamed(hf, layout), ours, t) for layout in _MULTIMODAL_LAYOUTS for hf, ours, t in GEMMA3_TABLE),
    not_loaded=(re.compile(r"(model\.)?(vision_tower|multi_modal_projector)\."),),
)


class Gemma3Family(ModelFamily):
    name = "gemma3_text"
    architecture = "Gemma3ForCausalLM"
    writes_head_dim = True
    hf_table = GEMMA3_TABLE
    activations = ("gelu_pytorch_tanh",)
    option_keys = frozenset({"sliding_window", "layer_types", "sliding_window_pattern", "rope_local_base_freq",
                             "query_pre_attn_scalar"})
    outer = (GEMMA3_MULTIMODAL,)

    def validate(self, cfg: Any) -> None:
        if cfg.attention_bias:
            raise unsupported("attention_bias", cfg.attention_bias, "false for gemma3_text (Gemma 3 has none)")

    def unwrap_hf(self, d: dict[str, Any]) -> dict[str, Any]:
        text = d.get("text_config")
        if not isinstance(text, dict):
            raise unsupported("text_config", text, "the language model's config (a mapping), which a "
                              "model_type 'gemma3' (Gemma3ForConditionalGeneration) config.json holds; for the "
                              "text model itself, model_type gemma3_text")
        if text.get("model_type", self.name) != self.name:
            raise unsupported("text_config.model_type", text["model_type"], repr(self.name))
        tied = text.get("tie_word_embeddings", True)
        if d.get("tie_word_embeddings", tied) != tied:
            raise unsupported("tie_word_embeddings", d["tie_word_embeddings"], f"{tied}, as text_config's")
        outer = {key: d[key] for key in _OUTER_TOKEN_IDS if d.get(key) is not None}
        if not any(key in text for key in _DTYPE_KEYS):
            outer.update({key: d[key] for key in _DTYPE_KEYS if key in d})
        return {**TEXT_CONFIG_DEFAULTS, **text, **outer, "model_type": self.name}

    def read_hf(self, d: dict[str, Any]) -> None:
        for key in _REFUSED_IF_SET:
            value = d.pop(key, None)
            if value:
                raise unsupported(key, value, "null / false (not implemented for gemma3_text)")
        for key in _IGNORED:
            d.pop(key, None)
        if "hidden_activation" in d:  # HF Gemma reads hidden_activation, not hidden_act
            d["hidden_act"] = d.pop("hidden_activation")
        d.setdefault("hidden_act", "gelu_pytorch_tanh")
        _read_rope_by_layer_type(d)
        options = {key: d.pop(key) for key in self.option_keys if d.get(key) is not None}
        d["family_options"] = tuple(sorted({**dict(d.get("family_options") or ()), **options}.items()))
        for key in self.option_keys:
            d.pop(key, None)

    def options(self, given: dict[str, Any], cfg: Any) -> tuple:
        unknown = sorted(set(given) - self.option_keys)
        if unknown:
            raise unsupported("family_options", unknown, " | ".join(sorted(self.option_keys)))
        values = {**DEFAULTS, **given}
        pattern = int(values.pop("sliding_window_pattern"))
        if values.get("layer_types") is None:
            values["layer_types"] = [GLOBAL if (i + 1) % pattern == 0 else SLIDING
                                     for i in range(cfg.num_hidden_layers)]
        values["layer_types"] = tuple(values["layer_types"])
        _check_options(values, cfg.num_hidden_layers)
        return tuple(sorted(values.items()))

    def qk_norm(self, cfg: Any) -> bool:
        return True

    def norm_adds_one(self, cfg: Any) -> bool:
        return True

    def post_norms(self, cfg: Any) -> bool:
        return True

    def embedding_scale(self, cfg: Any) -> float:
        return cfg.hidden_size ** 0.5

    def attention_scale(self, cfg: Any) -> float:
        return float(_option(cfg, "query_pre_attn_scalar")) ** -0.5

    def sliding_windows(self, cfg: Any) -> tuple[int, ...] | None:
        kinds = _option(cfg, "layer_types")
        if SLIDING not in kinds:
            return None
        window = int(_option(cfg, "sliding_window"))
        return tuple(window if kind == SLIDING else 0 for kind in kinds)

    def rope_scaling(self, block: dict | None) -> tuple | None:
        kind = rope_type(block)
        if kind == "default":
            return None
        if kind != "linear":
            raise unsupported("rope_scaling.rope_type", kind, "'default' | 'linear' for gemma3_text")
        if float(block.get("factor", 0)) <= 0:
            raise unsupported("rope_scaling.factor", block.get("factor"), "a positive number (linear scaling)")
        return (("factor", float(block["factor"])), ("rope_type", "linear"))

    def rope_frequencies(self, cfg: Any) -> jnp.ndarray:
        inv_freq = default_frequencies(cfg.head_dim, cfg.rope_theta)
        factor = dict(cfg.rope_scaling or ()).get("factor", 1.0)
        return inv_freq / jnp.float32(factor)  # linear scaling: positions divided by `factor`

    def sliding_rope_frequencies(self, cfg: Any) -> jnp.ndarray:
        return default_frequencies(cfg.head_dim, float(_option(cfg, "rope_local_base_freq")))

    def hf_extras(self, cfg: Any) -> dict[str, Any]:
        options = dict(cfg.family_options)
        return {"attention_bias": False, "hidden_activation": cfg.hidden_act,
                "sliding_window": options["sliding_window"], "layer_types": list(options["layer_types"]),
                "rope_local_base_freq": options["rope_local_base_freq"],
                "query_pre_attn_scalar": options["query_pre_attn_scalar"],
                "final_logit_softcapping": None, "attn_logit_softcapping": None}

    def tiny_changes(self) -> dict[str, Any]:
        # One sliding and one global layer; a window shorter than the test sequences.
        return {"hidden_act": "gelu_pytorch_tanh", "head_dim": 16,
                "family_options": (("layer_types", (SLIDING, GLOBAL)), ("sliding_window", 4))}


def _option(cfg: Any, key: str) -> Any:
    return dict(cfg.family_options)[key]


def _read_rope_by_layer_type(d: dict[str, Any]) -> None:
    """transformers 5.x writes `rope_parameters` per layer type: the global block becomes the shared
    rope keys, the sliding block's theta `rope_local_base_freq` (4.x keys pass through as they are)."""
    params = d.get("rope_parameters") or {}
    if GLOBAL not in params and SLIDING not in params:
        return
    local = params.get(SLIDING) or {}
    kind = local.get("rope_type", "default")
    if kind != "default":
        raise unsupported(f"rope_parameters.{SLIDING}.rope_type", kind, "'default' (sliding layers are not scaled)")
    if "rope_theta" in local:
        d["rope_local_base_freq"] = local["rope_theta"]
    d["rope_parameters"] = dict(params.get(GLOBAL) or {})


def _check_options(values: dict[str, Any], num_layers: int) -> None:
    kinds = values["layer_types"]
    if len(kinds) != num_layers or not set(kinds) <= {SLIDING, GLOBAL}:
        raise unsupported("layer_types", list(kinds), f"{num_layers} entries, each {SLIDING!r} or {GLOBAL!r}")
    for key in ("sliding_window", "rope_local_base_freq", "query_pre_attn_scalar"):
        if not isinstance(values[key], (int, float)) or isinstance(values[key], bool) or values[key] <= 0:
            raise unsupported(key, values[key], "a positive number")


GEMMA3 = Gemma3Family()
