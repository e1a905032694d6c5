"""int8 keys and values of the KV cache (`rollout.kv_cache_dtype: int8`).

A token's keys (or values) of one layer and KV head are quantized when they enter the cache,
symmetrically: scale = max |x| over head_dim / 127, x_int8 = round(x / scale). The cache holds
the int8 values [L, B, S, KV, D] and the f32 scales [L, B, S, KV, 1] (the cache's rank, 1 on
head_dim, so every index and sharding of the cache applies to both); reading a slice of it
dequantizes that slice to the compute dtype (`x_int8 * scale`, rounded once). Every reader of
`cache.k[...]` / `cache.v[...]` (the model's cached forward, the rollout's decode attention and
its shared-prompt cascade) therefore attends over the dequantized keys and values unchanged.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

INT8_CACHE = "int8"  # the cache dtype name that selects Int8KV (QwenModel.init_cache)
INT8_MAX = 127


@struct.dataclass
class Int8KV:
    """Cached keys or values: int8 values [L, B, S, KV, D], f32 scales [L, B, S, KV, 1], one per
    layer, row, slot and KV head; indexing gives the dequantized slice in `dtype`."""

    values: jax.Array
    scale: jax.Array
    dtype: Any = struct.field(pytree_node=False)

    @classmethod
    def zeros(cls, shape: tuple[int, ...], dtype: Any) -> Int8KV:
        return cls(jnp.zeros(shape, jnp.int8), jnp.zeros((*shape[:-1], 1), jnp.float32), dtype)

    def __getitem__(self, index) -> jax.Array:
        # Sliced first: only the slots read are dequantized, one rounding to the compute dtype.
        return (self.values[index].astype(jnp.float32) * self.scale[index]).astype(self.dtype)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.values.shape

    def write(self, new: jax.Array, start: tuple) -> Int8KV:
        """`new` [1, B, T, KV, D] quantized into the slots at `start` (layer, 0, slot, 0, 0)."""
        values, scale = quantize_heads(new)
        return self.replace(values=jax.lax.dynamic_update_slice(self.values, values, start),
                            scale=jax.lax.dynamic_update_slice(self.scale, scale, start))


def quantize_heads(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(int8 values, f32 scales) of x [..., D], one symmetric scale per vector over its last axis."""
    x = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x), axis=-1, keepdims=True)
    scale = jnp.where(amax > 0, amax / INT8_MAX, 1.0)  # an all-zero head stays zero
    return jnp.clip(jnp.round(x / scale), -INT8_MAX, INT8_MAX).astype(jnp.int8), scale


def write_slots(store: jax.Array | Int8KV, new: jax.Array, start: tuple) -> jax.Array | Int8KV:
    """`store` with new [1, B, T, KV, D] at `start`: cast to its dtype, or quantized into an Int8KV."""
    if isinstance(store, Int8KV):
        return store.write(new, start)
    return jax.lax.dynamic_update_slice(store, new.astype(store.dtype), start)
