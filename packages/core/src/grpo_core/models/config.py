"""`QwenConfig`: the architecture of a model of the shared decoder (Qwen2 / Qwen2.5 / Qwen3,
Llama 3.x, or a plugin's family), read from and written to a Hugging Face `config.json`.

Its `model_type` names the family (`grpo_core.model_families`), which answers every
question that differs between families. Only options this implementation reproduces exactly
are accepted; anything else (an unimplemented rope scaling, sliding-window attention, another
activation, ...) is a ValueError that names the key, the value seen, and what is supported.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any

import jax.numpy as jnp

from grpo_core.model_families import (ModelFamily, family_named, language_model_hf_dict, publish, published_names,
                                     unsupported)
from grpo_core.models.gemma3_family import GEMMA3
from grpo_core.models.llama_family import LLAMA
from grpo_core.models.qwen3_moe_family import QWEN3_MOE
from grpo_core.models.qwen_family import QWEN2, QWEN3

BUILTIN_FAMILIES = (QWEN2, QWEN3, LLAMA, GEMMA3, QWEN3_MOE)
publish(list(BUILTIN_FAMILIES))
SUPPORTED_DTYPES = ("float32", "bfloat16", "float16")

# Bookkeeping keys of HF configs that do not change the forward pass.
_IGNORED_KEYS = frozenset(
    {
        "architectures",
        "auto_map",
        "transformers_version",
        "use_cache",
        "initializer_range",
        "pad_token_id",
        "sliding_window",
        "max_window_layers",
        "_name_or_path",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
        "layer_types",
        "pretraining_tp",  # Llama: a tensor-parallel split of the original training, no effect on outputs
        "output_router_logits",  # MoE: whether HF returns router logits, no effect on outputs
    }
)

# Keys that change the forward pass in ways not implemented here: allowed value only.
_ONLY_ALLOWED = {"quantization_config": None, "partial_rotary_factor": 1.0, "mlp_bias": False}
# config.json keys `from_hf_dict` reads without a QwenConfig field of the same name.
HF_EXTRA_KEYS = frozenset({"torch_dtype", "dtype", "rope_parameters", "use_sliding_window", "num_local_experts"})


def architecture_keys() -> frozenset[str]:
    """Every key a `model.architecture` mapping may hold (a typo is an error, not a default)."""
    family_keys = frozenset().union(*(family_named(name).option_keys for name in published_names()))
    return frozenset(f.name for f in dataclasses.fields(QwenConfig)) | HF_EXTRA_KEYS | family_keys


_unsupported = unsupported


@dataclass(frozen=True)
class QwenConfig:
    """Architecture hyper-parameters, named as in HF `config.json`."""

    model_type: str = "qwen2"
    vocab_size: int = 151936
    hidden_size: int = 896
    intermediate_size: int = 4864
    num_hidden_layers: int = 24
    num_attention_heads: int = 14
    num_key_value_heads: int = 2
    head_dim: int = 0  # 0 = hidden_size // num_attention_heads (the Qwen2 rule)
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    hidden_act: str = "silu"
    tie_word_embeddings: bool = True
    max_position_embeddings: int = 32768
    torch_dtype: str = "bfloat16"
    attention_bias: bool | None = None  # None = the family's default (qwen2 True, qwen3 and llama False)
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    # HF rope_scaling as sorted (key, value) pairs (hashable), None = plain RoPE; the family reads it.
    rope_scaling: tuple | None = None
    # The family's own config.json keys as sorted (key, value) pairs (Gemma's sliding window, ...).
    family_options: tuple = ()
    # Sparse MoE MLP (qwen3_moe); 0 experts = the dense SwiGLU MLP of `intermediate_size`.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    router_aux_loss_coef: float = 0.0

    def __post_init__(self) -> None:
        family = family_named(self.model_type)
        if not self.head_dim:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if self.attention_bias is None:
            object.__setattr__(self, "attention_bias", family.attention_bias)
        for name in ("eos_token_id", "mlp_only_layers"):
            if isinstance(getattr(self, name), list):
                object.__setattr__(self, name, tuple(getattr(self, name)))
        scaling = self.rope_scaling
        object.__setattr__(self, "rope_scaling", family.rope_scaling(dict(scaling) if scaling else None))
        object.__setattr__(self, "family_options", family.options(dict(self.family_options), self))
        self._validate()
        family.validate(self)

    def _validate(self) -> None:
        if self.hidden_act not in self.family.activations:
            raise _unsupported("hidden_act", self.hidden_act, " | ".join(map(repr, self.family.activations)))
        if self.torch_dtype not in SUPPORTED_DTYPES:
            raise _unsupported("torch_dtype", self.torch_dtype, " | ".join(SUPPORTED_DTYPES))
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"QwenConfig.{name} must be positive, got {getattr(self, name)}.")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads={self.num_key_value_heads} (grouped-query attention)."
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings.")
        if self.num_experts and not family_named(self.model_type).sparse_mlp:
            raise _unsupported("num_experts", self.num_experts, f"0 for model_type {self.model_type} (a dense MLP)")

    # ---- derived (the family's answers) ----------------------------------------------
    @property
    def family(self) -> ModelFamily:
        return family_named(self.model_type)

    @property
    def has_qk_norm(self) -> bool:
        return self.family.qk_norm(self)

    @property
    def has_o_bias(self) -> bool:
        return self.family.o_bias(self)

    @property
    def sliding_windows(self) -> tuple[int, ...] | None:
        """Per layer the sliding window (0: global), None when no layer has one."""
        return self.family.sliding_windows(self)

    @property
    def plain_decoder(self) -> bool:
        """Every layer is the plain pre-norm block with full attention on unscaled embeddings (what
        the rollout's own decode step runs; grpo_rollout.attention)."""
        family = self.family
        return self.sliding_windows is None and not family.post_norms(self) and family.embedding_scale(self) is None

    def rope_frequencies(self) -> jnp.ndarray:
        """Inverse RoPE frequencies [head_dim / 2] in f32, the family's scaling applied."""
        return self.family.rope_frequencies(self)

    def replace(self, **changes: Any) -> QwenConfig:
        return dataclasses.replace(self, **changes)

    def check_tokenizer_fits(self, tokenizer_size: int,
                             fix: str = "use a model with vocab_size >= len(tokenizer)") -> None:
        """A token id past the embedding table would be invalid: ValueError naming the `fix`."""
        if tokenizer_size > self.vocab_size:
            raise ValueError(f"the tokenizer has {tokenizer_size} tokens but the model's vocab_size is "
                             f"{self.vocab_size}; {fix}")

    # ---- HF config.json ------------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> QwenConfig:
        """Build from a parsed HF `config.json` (transformers 4.x or 5.x layout); a multimodal
        checkpoint's that a family reads (`gemma3`) gives its language model's config."""
        family, d = language_model_hf_dict(dict(d))
        d = dict(d)
        d["model_type"] = family.name
        family.read_hf(d)
        _read_rope(d)
        _check_attention_options(d)
        fields = {f.name for f in dataclasses.fields(cls)}
        kwargs: dict[str, Any] = {}
        dtype = d.pop("torch_dtype", None) or d.pop("dtype", None)
        d.pop("dtype", None)
        if dtype is not None:
            kwargs["torch_dtype"] = str(dtype).removeprefix("torch.")
        for key, value in d.items():
            if key in fields:
                kwargs[key] = value
        if kwargs.get("head_dim") is None:
            kwargs.pop("head_dim", None)
        return cls(**kwargs)

    @classmethod
    def from_pretrained_dir(cls, path: str | os.PathLike) -> QwenConfig:
        return cls.from_hf_dict(read_config_json(path))

    def to_hf_dict(self) -> dict[str, Any]:
        """An HF `config.json` dict that transformers 4.50+ and 5.x both load."""
        family = self.family
        d: dict[str, Any] = {
            "architectures": [family.architecture],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "hidden_act": self.hidden_act,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": dict(self.rope_scaling) if self.rope_scaling else None,
            "tie_word_embeddings": self.tie_word_embeddings,
            "torch_dtype": self.torch_dtype,
            "attention_dropout": 0.0,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id,
        }
        d.update(family.hf_extras(self))
        if family.writes_head_dim or self.head_dim != self.hidden_size // self.num_attention_heads:
            d["head_dim"] = self.head_dim  # HF Qwen2 and Llama honour an explicit head_dim attribute
        return d

    # ---- presets -------------------------------------------------------------------
    @classmethod
    def tiny(cls, model_type: str = "qwen2", **changes: Any) -> QwenConfig:
        """A few-kB model for tests and CPU smoke runs."""
        base = cls(
            model_type=model_type,
            **family_named(model_type).tiny_changes(),
            vocab_size=128,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            rope_theta=10_000.0,
            tie_word_embeddings=True,
            max_position_embeddings=512,
            torch_dtype="float32",
        )
        return base.replace(**changes)


def read_config_json(path: str | os.PathLike) -> dict[str, Any]:
    """The parsed config.json of model directory `path`."""
    config_path = os.path.join(os.fspath(path), "config.json")
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"{config_path} not found: a model directory needs an HF config.json.")
    try:
        with open(config_path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{config_path} is not valid JSON ({e}).") from e


def _read_rope(d: dict[str, Any]) -> None:
    """Read theta and the scaling from either HF layout (4.x `rope_scaling`, 5.x `rope_parameters`)
    into d['rope_theta'] and d['rope_scaling'] (the family checks the scaling)."""
    params = d.pop("rope_parameters", None) or {}
    scaling = {**params, **(d.pop("rope_scaling", None) or {})}
    if "rope_theta" in params:
        d.setdefault("rope_theta", params["rope_theta"])
    scaling.pop("rope_theta", None)
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    d["rope_scaling"] = None if kind == "default" else scaling


def _check_attention_options(d: dict[str, Any]) -> None:
    if d.get("use_sliding_window"):
        raise _unsupported("use_sliding_window", d["use_sliding_window"], "false (full causal attention only)")
    d.pop("use_sliding_window", None)
    dropout = d.pop("attention_dropout", 0.0) or 0.0
    if dropout != 0.0:
        raise _unsupported("attention_dropout", dropout, "0.0")
    for key, allowed in _ONLY_ALLOWED.items():
        if d.get(key, allowed) not in (allowed, None):
            raise _unsupported(key, d[key], repr(allowed))
        d.pop(key, None)
    for key in _IGNORED_KEYS:
        d.pop(key, None)
