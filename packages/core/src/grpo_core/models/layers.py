"""Building blocks of the shared decoder (every model family): parameters with logical axis names,
projections, RMSNorm, rotary embeddings and the gated (SwiGLU / GeGLU) MLP.

Logical axis names used on parameters (mapped to mesh axes by `grpo_core.sharding`):
`vocab`, `embed`, `heads`, `kv_heads`, `head_dim`, `mlp`, `norm` (and `expert` on MoE expert weights, see moe.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

Names = tuple[str | None, ...]

# HF initializer_range default; only matters for random-init models.
INIT_STD = 0.02


def logical_param(rngs: nnx.Rngs, init: Callable, shape: Sequence[int], dtype: jnp.dtype, names: Names) -> nnx.Param:
    """A parameter whose `out_sharding` metadata holds its logical axis names.

    Eager sharding is off: placement is decided later from a rule table
    (`grpo_core.sharding.param_shardings`), never at construction time.
    """
    if len(names) != len(shape):
        raise ValueError(f"logical names {names} do not match parameter shape {tuple(shape)}")
    value = init(rngs.params(), tuple(shape), dtype)
    return nnx.Param(value, out_sharding=tuple(names), eager_sharding=False)


def _ones(key, shape, dtype):
    return jnp.ones(shape, dtype)


def _zeros(key, shape, dtype):
    return jnp.zeros(shape, dtype)


_normal = jax.nn.initializers.normal(INIT_STD)


def contract_f32(x: jax.Array, kernel: Any, dims: tuple) -> jax.Array:
    """x . kernel over `dims` (x's axes, the kernel's), accumulated and returned in f32 for bf16
    params too (as HF's bf16 matmuls do); a quantized kernel (grpo_rollout.quantize) runs its own."""
    if hasattr(kernel, "contract"):
        return kernel.contract(x, dims)
    return jax.lax.dot_general(x, kernel, (dims, ((), ())), preferred_element_type=jnp.float32)


class Projection(nnx.Module):
    """y = x . kernel (+ bias), contracting the last `len(in_shape)` axes of x.

    Kernels keep heads and head_dim as separate axes (e.g. q_proj is
    [embed, heads, head_dim]) so sharding over heads never splits a head.
    """

    def __init__(self, in_shape, out_shape, names: Names, *, bias: bool, dtype, rngs: nnx.Rngs):
        in_shape, out_shape = tuple(in_shape), tuple(out_shape)
        self.n_in = len(in_shape)
        self.kernel = logical_param(rngs, _normal, in_shape + out_shape, dtype, names)
        self.bias = logical_param(rngs, _zeros, out_shape, dtype, names[self.n_in :]) if bias else None

    def __call__(self, x: jax.Array) -> jax.Array:
        contract = (tuple(range(x.ndim - self.n_in, x.ndim)), tuple(range(self.n_in)))
        y = contract_f32(x, self.kernel.get_value(), contract)
        adapter = getattr(self, "lora", None)  # a LoRA adapter attached by grpo_core.models.lora
        if adapter is not None:
            y = y + adapter(x)
        if self.bias is not None:
            y = y + self.bias[...]
        return y.astype(x.dtype)


class RMSNorm(nnx.Module):
    """HF Qwen RMSNorm: statistics in f32, cast back, then scale (same op order as HF).
    adds_one (Gemma): the scale is 1 + weight (weights start at 0), applied in f32 before the cast."""

    def __init__(self, dim: int, eps: float, *, dtype, rngs: nnx.Rngs, adds_one: bool = False):
        self.eps = eps
        self.adds_one = adds_one
        self.scale = logical_param(rngs, _zeros if adds_one else _ones, (dim,), dtype, ("norm",))

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        variance = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)
        normed = x32 * jax.lax.rsqrt(variance + self.eps)
        if self.adds_one:
            return (normed * (1.0 + self.scale[...].astype(jnp.float32))).astype(x.dtype)
        return self.scale[...] * normed.astype(x.dtype)


class Embedding(nnx.Module):
    def __init__(self, vocab: int, dim: int, *, dtype, rngs: nnx.Rngs):
        self.embedding = logical_param(rngs, _normal, (vocab, dim), dtype, ("vocab", "embed"))

    def __call__(self, ids: jax.Array) -> jax.Array:
        return jnp.take(self.embedding[...], ids, axis=0)  # [B, T, H]


# HF `hidden_act` names; gelu_pytorch_tanh is the tanh approximation of GELU (Gemma's GeGLU).
ACTIVATIONS: dict[str, Callable] = {"silu": jax.nn.silu,
                                    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True)}


class MLP(nnx.Module):
    """Gated MLP: down(act(gate(x)) * up(x)); SwiGLU with silu, GeGLU with gelu_pytorch_tanh."""

    def __init__(self, hidden: int, intermediate: int, *, dtype, rngs: nnx.Rngs, activation: str = "silu"):
        self.activation = activation
        self.gate_proj = Projection((hidden,), (intermediate,), ("embed", "mlp"), bias=False, dtype=dtype, rngs=rngs)
        self.up_proj = Projection((hidden,), (intermediate,), ("embed", "mlp"), bias=False, dtype=dtype, rngs=rngs)
        self.down_proj = Projection((intermediate,), (hidden,), ("mlp", "embed"), bias=False, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(ACTIVATIONS[self.activation](self.gate_proj(x)) * self.up_proj(x))


# ---- rotary position embeddings -----------------------------------------------------
def rope_tables(positions: jax.Array, inv_freq: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos/sin [B, T, head_dim/2] in f32 for integer positions [B, T] and the inverse
    frequencies [head_dim/2] of the model's family (`QwenConfig.rope_frequencies()`)."""
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, D/2]
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate x [B, T, N, D] by the HF "rotate_half" convention, in f32."""
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)  # [B, T, N, D/2] each
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x.dtype)
