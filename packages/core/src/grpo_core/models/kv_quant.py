"""8-bit keys and values of the KV cache (`rollout.kv_cache_dtype: int8 | fp8`).

A token's keys (or values) of one layer and KV head are quantized when they enter the cache,
symmetrically: scale = max |x| over head_dim / the format's largest value, int8: 127 and
x_q = round(x / scale); fp8 (e4m3): 448 and x_q = x / scale rounded to e4m3's 3-bit mantissa (a
relative error of at most 2^-4 per element, against int8's absolute half step). The cache holds
the 8-bit values [L, B, S, KV, D] and the f32 scales [L, B, S, KV, 1] (the cache's rank, 1 on
head_dim, so every index and sharding of the cache applies to both); reading a slice of it
dequantizes that slice to the compute dtype (`x_q * scale`, rounded once). Every reader of
`cache.k[...]` / `cache.v[...]` (the model's cached forward, the rollout's decode attention and
its shared-prompt cascade) therefore attends over the dequantized keys and values unchanged.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

FP8 = jnp.float8_e4m3fn  # the e4m3 of H100/H200 and of the OCP 8-bit formats; no inf, max 448
STORED = {"int8": jnp.int8, "fp8": FP8}  # the cache dtype names that select QuantizedKV (QwenModel.init_cache)
LARGEST = {"int8": 127.0, "fp8": float(jnp.finfo(FP8).max)}


@struct.dataclass
class QuantizedKV:
    """Cached keys or values: 8-bit values (int8 or fp8) [L, B, S, KV, D], f32 scales [L, B, S, KV, 1],
    one per layer, row, slot and KV head; indexing gives the dequantized slice in `dtype`."""

    values: jax.Array
    scale: jax.Array
    dtype: Any = struct.field(pytree_node=False)

    @classmethod
    def zeros(cls, shape: tuple[int, ...], dtype: Any, mode: str = "int8") -> QuantizedKV:
        return cls(jnp.zeros(shape, STORED[mode]), jnp.zeros((*shape[:-1], 1), jnp.float32), dtype)

    @property
    def mode(self) -> str:
        return "fp8" if self.values.dtype == FP8 else "int8"

    def __getitem__(self, index) -> jax.Array:
        # Sliced first: only the slots read are dequantized, one rounding to the compute dtype.
        return (self.values[index].astype(jnp.float32) * self.scale[index]).astype(self.dtype)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.values.shape

    def write(self, new: jax.Array, start: tuple) -> QuantizedKV:
        """`new` [1, B, T, KV, D] quantized into the slots at `start` (layer, 0, slot, 0, 0)."""
        values, scale = quantize_heads(new, self.mode)
        return self.replace(values=jax.lax.dynamic_update_slice(self.values, values, start),
                            scale=jax.lax.dynamic_update_slice(self.scale, scale, start))


def quantize_symmetric(x: jax.Array, axes: tuple[int, ...], mode: str) -> tuple[jax.Array, jax.Array]:
    """(`mode` (int8 | fp8) values, f32 scales) of x, one symmetric scale per slice over `axes` (kept,
    as 1): scale = max |x| / the format's largest; int8 rounds x / scale, fp8 casts it (the weights'
    quantization too: grpo_rollout.quantize)."""
    x = x.astype(jnp.float32)
    largest = LARGEST[mode]
    amax = jnp.max(jnp.abs(x), axis=axes, keepdims=True)
    scale = jnp.where(amax > 0, amax / largest, 1.0)  # an all-zero slice stays zero
    scaled = jnp.clip(x / scale, -largest, largest)  # rounding may lift amax / scale a hair past it
    return (scaled.astype(FP8) if mode == "fp8" else jnp.round(scaled).astype(jnp.int8)), scale


def quantize_heads(x: jax.Array, mode: str = "int8") -> tuple[jax.Array, jax.Array]:
    """(`mode` values, f32 scales) of x [..., D], one symmetric scale per vector over its last axis."""
    return quantize_symmetric(x, (-1,), mode)


def write_slots(store: jax.Array | QuantizedKV, new: jax.Array, start: tuple) -> jax.Array | QuantizedKV:
    """`store` with new [1, B, T, KV, D] at `start`: cast to its dtype, or quantized into a QuantizedKV."""
    if isinstance(store, QuantizedKV):
        return store.write(new, start)
    return jax.lax.dynamic_update_slice(store, new.astype(store.dtype), start)
