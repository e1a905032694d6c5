"""Grouped-query attention and its KV cache.

The cache is a fixed-shape pytree so a jitted decode loop can carry (and donate) it:

    k, v   [L, B, S_max, kv_heads, head_dim]  keys/values of every layer (or a QuantizedKV of them:
                                              int8 or fp8 with a scale per token and head, kv_quant.py)
    mask   [B, S_max] bool                    slot holds a real (non-pad) token
    index  [] int32                           next slot to write, shared by all rows

Rows are aligned on slots (left-padded prompts fill slots [0, T_prompt)), so one write
index serves the whole batch; per-row lengths come from `mask`.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx, struct

from grpo_core.models.attention_impls import CHUNK, CausalMask, memory_efficient_attention
from grpo_core.models.config import QwenConfig
from grpo_core.models.kv_quant import QuantizedKV, write_slots
from grpo_core.models.layers import Projection, RMSNorm, apply_rope

# Finite "minus infinity": a row with no visible key (a left-pad query) then gets a
# uniform softmax instead of NaN; its output is never used.
_MASKED = float(jnp.finfo(jnp.float32).min)


@struct.dataclass
class KVCache:
    k: jax.Array | QuantizedKV  # [L, B, S_max, KV, D]
    v: jax.Array | QuantizedKV  # [L, B, S_max, KV, D]
    mask: jax.Array  # [B, S_max] bool
    index: jax.Array  # [] int32

    @classmethod
    def zeros(cls, cfg: QwenConfig, batch: int, max_len: int, dtype: Any, quantized: str | None = None) -> KVCache:
        """quantized (int8 | fp8): keys and values stored as a QuantizedKV, read back in `dtype`."""
        shape = (cfg.num_hidden_layers, batch, max_len, cfg.num_key_value_heads, cfg.head_dim)
        store = functools.partial(QuantizedKV.zeros, mode=quantized) if quantized else jnp.zeros
        return cls(
            k=store(shape, dtype),
            v=store(shape, dtype),
            mask=jnp.zeros((batch, max_len), jnp.bool_),
            index=jnp.zeros((), jnp.int32),
        )

    @staticmethod
    def logical_axes() -> KVCache:
        """Logical axis names of each field, for `grpo_core.sharding.named_sharding`."""
        kv = ("layers", "batch", "cache_seq", "kv_heads", "head_dim")
        return KVCache(k=kv, v=kv, mask=("batch", "cache_seq"), index=())

    @property
    def max_len(self) -> int:
        return self.mask.shape[1]

    def lengths(self) -> jax.Array:
        """Real tokens cached per row [B] = the position of each row's next token."""
        return jnp.sum(self.mask, axis=1, dtype=jnp.int32)

    def with_new_tokens(self, token_mask: jax.Array) -> KVCache:
        """Mark slots [index, index+T) with token_mask [B, T]; index is advanced later."""
        mask = jax.lax.dynamic_update_slice(self.mask, token_mask.astype(jnp.bool_), (0, self.index))
        return self.replace(mask=mask)

    def visibility(self, num_queries: int) -> jax.Array:
        """[B, T, S_max]: query t (slot index+t) sees real slots s <= index+t."""
        query_slot = self.index + jnp.arange(num_queries)  # [T]
        causal = jnp.arange(self.max_len)[None, :] <= query_slot[:, None]  # [T, S]
        return self.mask[:, None, :] & causal[None]

    def write_layer(self, layer: int, k: jax.Array, v: jax.Array) -> KVCache:
        """Store one layer's new keys/values [B, T, KV, D] at slots [index, index+T) (quantized
        there in an 8-bit cache)."""
        start = (layer, 0, self.index, 0, 0)
        return self.replace(k=write_slots(self.k, k[None], start), v=write_slots(self.v, v[None], start))

    def advance(self, num_tokens: int) -> KVCache:
        return self.replace(index=self.index + num_tokens)


def causal_visibility(token_mask: jax.Array) -> jax.Array:
    """[B, T, T] for a cache-free forward: causal and key is a real token."""
    t = token_mask.shape[1]
    causal = jnp.tril(jnp.ones((t, t), jnp.bool_))
    return token_mask[:, None, :].astype(jnp.bool_) & causal[None]


def grouped_query_attention(q: jax.Array, k: jax.Array, v: jax.Array, visible: jax.Array) -> jax.Array:
    """softmax(q k^T / sqrt(D)) v with q [B, T, N, D], k/v [B, S, KV, D], visible [B, T, S].

    Query head n uses kv head n // G (HF repeat_kv order); queries are reshaped to
    [B, T, KV, G, D] so K/V are never repeated. Scores and softmax are f32.
    """
    b, t, n, d = q.shape
    kv_heads = k.shape[2]
    q = q.reshape(b, t, kv_heads, n // kv_heads, d)
    scores = jnp.einsum("btkgd,bskd->bkgts", q, k, preferred_element_type=jnp.float32)
    scores = jnp.where(visible[:, None, None], scores * d**-0.5, _MASKED)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v)
    return out.reshape(b, t, n, d)


def attend(q: jax.Array, k: jax.Array, v: jax.Array, mask: CausalMask) -> jax.Array:
    """Attention by mask.impl; a single query (a decode step) always runs the dense path,
    whose [B, KV, G, 1, S] scores are small, and so do keys that fit one chunk: their dense
    scores take no more memory than one chunk of the chunked path, without its padding."""
    one_chunk = mask.impl == "chunked" and k.shape[1] <= CHUNK
    if mask.impl == "xla" or q.shape[1] == 1 or one_chunk:
        return grouped_query_attention(q, k, v, mask.dense(q.shape[1]))
    return memory_efficient_attention(q, k, v, mask)


class Attention(nnx.Module):
    """Grouped-query self-attention: Qwen2 (q/k/v bias), Qwen3 / Gemma 3 (per-head q/k RMSNorm)."""

    def __init__(self, cfg: QwenConfig, *, dtype, rngs: nnx.Rngs):
        h, n, kv, d = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        bias = bool(cfg.attention_bias)
        self.q_proj = Projection((h,), (n, d), ("embed", "heads", "head_dim"), bias=bias, dtype=dtype, rngs=rngs)
        self.k_proj = Projection((h,), (kv, d), ("embed", "kv_heads", "head_dim"), bias=bias, dtype=dtype, rngs=rngs)
        self.v_proj = Projection((h,), (kv, d), ("embed", "kv_heads", "head_dim"), bias=bias, dtype=dtype, rngs=rngs)
        self.o_proj = Projection(
            (n, d), (h,), ("heads", "head_dim", "embed"), bias=cfg.has_o_bias, dtype=dtype, rngs=rngs
        )
        norm, adds_one = cfg.has_qk_norm, cfg.family.norm_adds_one(cfg)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps, dtype=dtype, rngs=rngs, adds_one=adds_one) if norm else None
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps, dtype=dtype, rngs=rngs, adds_one=adds_one) if norm else None
        # The attention kernels scale scores by D**-0.5; a family's other scale goes onto q.
        self.q_factor = cfg.family.attention_scale(cfg) * d**0.5

    def project_qkv(self, x: jax.Array, cos: jax.Array, sin: jax.Array):
        """x [B, T, H] -> rotated q [B, T, N, D], k [B, T, KV, D], v [B, T, KV, D]."""
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q, cos, sin)
        if abs(self.q_factor - 1.0) > 1e-12:
            q = (q.astype(jnp.float32) * self.q_factor).astype(q.dtype)
        return q, apply_rope(k, cos, sin), v

    def __call__(self, x, cos, sin, visible: CausalMask, cache: KVCache | None = None, layer: int = 0):
        """Returns (output [B, T, H], cache with this layer's keys/values written)."""
        q, k, v = self.project_qkv(x, cos, sin)
        if cache is not None:
            cache = cache.write_layer(layer, k, v)
            k, v = cache.k[layer], cache.v[layer]  # [B, S_max, KV, D]
        out = attend(q, k.astype(q.dtype), v.astype(q.dtype), visible)
        return self.o_proj(out), cache
