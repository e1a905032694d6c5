"""`rollout.quantize: fp8_block`: fp8 (e4m3) projection weights with one scale per 128 x 128 block.

Per-channel scales (`int8`, `fp8`) take one scale per output channel over all its inputs; a block
scale covers 128 consecutive inputs by 128 consecutive outputs (the inputs and the outputs each
flattened in row-major order, e.g. q_proj [H, heads, head_dim]: 128 of H by one head of 128), so an
outlying weight coarsens only its block. The scale keeps the kernel's rank: along each axis it has
size/extent entries, where a block spans `extent` consecutive elements of that axis (full on the
trailing axes it covers, 1 on the leading ones); per-channel scales are the case of full input
extents and output extents of 1, so dequantization and sharding treat both alike.

A projection whose scales vary along its inputs (`contract_blocks`) multiplies the kernel
dequantized block by block (8-bit value times its block's scale, rounded once to the compute dtype)
rather than summing a partial product per input block: XLA:CPU computed that batched form wrongly
inside the decode's layer loop. Whether the TPU compiler fuses the dequantization into the matmul's
operand read (8-bit bytes from HBM) is not checked here; per-channel kernels keep their scaled-product
path (grpo_rollout.quantize).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from grpo_core.models.kv_quant import quantize_symmetric

BLOCK = 128


def block_extents(sizes: tuple[int, ...], block: int = BLOCK) -> tuple[int, ...]:
    """Per axis of `sizes`, how many consecutive elements a block spans so that it covers `block`
    consecutive elements of the axes flattened in row-major order (all of them when fewer)."""
    extents, left = [], block
    for size in reversed(sizes):
        if left == 1 or size % left == 0:
            extents.append(min(left, size))
            left = 1
        elif left % size == 0:
            extents.append(size)
            left //= size
        else:
            raise ValueError(f"rollout.quantize=fp8_block: a kernel axis of {size} does not split into blocks of "
                             f"{block} consecutive weights (axes {sizes}); use rollout.quantize=fp8 (per-channel).")
    return tuple(reversed(extents))


def kernel_extents(shape: tuple[int, ...], in_axes: tuple[int, ...]) -> tuple[int, ...]:
    """Block extents of a kernel [lead..., in..., out...] (a stacked kernel leads with its layers: extent 1)."""
    first, end = in_axes[0], in_axes[-1] + 1
    return (1,) * first + block_extents(shape[first:end]) + block_extents(shape[end:])


def quantize_blocks(kernel: jax.Array, in_axes: tuple[int, ...]) -> tuple[jax.Array, jax.Array]:
    """(fp8 values in the kernel's shape, f32 block scales [size / extent per axis])."""
    extents = kernel_extents(kernel.shape, in_axes)
    blocks = kernel.reshape([d for size, e in zip(kernel.shape, extents) for d in (size // e, e)])
    values, scale = quantize_symmetric(blocks, tuple(range(1, blocks.ndim, 2)), "fp8")
    return values.reshape(kernel.shape), scale.reshape([size // e for size, e in zip(kernel.shape, extents)])


def broadcastable(scale: jax.Array, shape: tuple[int, ...]) -> bool:
    """Each scale axis is 1 or the values' own size: a per-channel scale, plain broadcasting applies."""
    return all(s in (1, n) for s, n in zip(scale.shape, shape))


def expand(x: jax.Array, scale: jax.Array) -> jax.Array:
    """x (f32) times the scale of its block, for x and scale of one rank (scale size / extent per axis)."""
    if broadcastable(scale, x.shape):
        return x * scale
    split = [d for n, s in zip(x.shape, scale.shape) for d in (s, n // s)]
    return (x.reshape(split) * scale.reshape([d for s in scale.shape for d in (s, 1)])).reshape(x.shape)


def contract_blocks(x: jax.Array, values: jax.Array, scale: jax.Array, n_in: int) -> jax.Array:
    """x [..., in...] . kernel [in..., out...] in f32 with scales per input block: the kernel
    dequantized block by block (8-bit values times their block's scale, in x's dtype) into the
    matmul, for the compiler to fuse into the dot's operand read."""
    kernel = expand(values.astype(jnp.float32), scale).astype(x.dtype)
    dims = (tuple(range(x.ndim - n_in, x.ndim)), tuple(range(n_in)))
    return jax.lax.dot_general(x, kernel, (dims, ((), ())), preferred_element_type=jnp.float32)
