"""`rollout.quantize: int8 | fp8`: the rollout's projection matmuls read 8-bit weights.

Each projection kernel (q/k/v/o, gate/up/down, an untied LM head) is quantized per output
channel, symmetrically: scale = max |w| over the input axes / the format's largest value
(int8: 127, w_q = round(w / scale); fp8 e4m3: 448, w_q = w / scale rounded to e4m3's 3-bit
mantissa, so the relative error per weight is at most 2^-4 instead of int8's absolute half step).
It happens on device once per rollout, in `JaxRollout.load_weights`, from the weights the
trainer just updated (with LoRA: the merged kernels, or the base kernels under the per-token
adapters, which stay in full precision). The kernel's value becomes a `QuantizedKernel`, a pytree
of the 8-bit values and the scales; the model's projections and untied head call its
`contract` (x . w_q in f32, times the scale per output channel) instead of a matmul, inside the
layer scan on that layer's 8-bit slice, so the loop holds 8-bit weights. The embedding (a
gather, and the tied LM head) stays in full precision.

qwix (Google's JAX quantization library) was read and not used: it quantizes a Flax model by
intercepting the `dot_general` calls of one traced method (`__call__` for NNX) and swapping
the model's params for its own quantized array types; the decode never calls the model's
`__call__` (it runs `grpo_rollout.attention.decode_forward` over the model's modules, one
`lax.scan` over stacked layers), and a changed graph would reach into every decode layout.

`rollout.kv_cache_dtype: int8 | fp8` is the model's cache (grpo_core.models.kv_quant); what the
backend cannot decode on it is `kv_cache_refusal`.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx, struct
from jax.sharding import NamedSharding

from grpo_core.models.kv_quant import FP8, LARGEST, quantize_symmetric  # noqa: F401 (FP8 re-exported)
from grpo_core.models.layers import Projection
from grpo_rollout.model_parallel import scale_spec
from grpo_rollout.quantize_blocks import contract_blocks, expand, quantize_blocks

QUANTIZE_MODES = ("none", "int8", "fp8", "fp8_block")  # fp8_block: grpo_rollout.quantize_blocks
KV_CACHE_DTYPES = ("auto", "int8", "fp8")  # rollout.kv_cache_dtype (the 8-bit caches: grpo_core.models.kv_quant)
FP8_MAX = LARGEST["fp8"]


@struct.dataclass
class QuantizedKernel:
    """A projection kernel as 8-bit values (int8 or fp8) [..., in..., out...] and f32 scales of
    the same rank (per channel: 1 on the input axes; per block: size / extent on every axis,
    grpo_rollout.quantize_blocks); indexing it gives the dequantized kernel in `dtype`."""

    values: jax.Array
    scale: jax.Array
    dtype: Any = struct.field(pytree_node=False)

    def __getitem__(self, index) -> jax.Array:
        # One rounding, to the compute dtype: the product of two exact f32 factors.
        return expand(self.values.astype(jnp.float32), self.scale).astype(self.dtype)[index]

    def contract(self, x: jax.Array, axes: tuple) -> jax.Array:
        """x . kernel in f32, as `Projection` computes it: the 8-bit values (exact in bfloat16)
        enter the matmul as they are and the per-output-channel scale multiplies its result, so
        the compiler can read the 8-bit weights straight into the matmul (a dequantized copy
        costs more weight bytes than the full-precision kernel). Block scales along the inputs: per
        input block (grpo_rollout.quantize_blocks; x's contracted axes are its last, as Projection's)."""
        n_in = len(axes[1])
        if math.prod(self.scale.shape[:n_in]) > 1:
            return contract_blocks(x, self.values, self.scale, n_in)
        product = jax.lax.dot_general(x, self.values.astype(x.dtype), (axes, ((), ())),
                                      preferred_element_type=jnp.float32)
        rows = product.ndim - self.values.ndim + n_in
        return expand(product, self.scale.reshape((1,) * rows + self.scale.shape[n_in:]))

    @property
    def shape(self) -> tuple[int, ...]:
        return self.values.shape


@functools.partial(jax.jit, static_argnames=("in_axes", "mode"))
def quantize_kernel(kernel: jax.Array, in_axes: tuple[int, ...], mode: str = "int8") -> QuantizedKernel:
    """Symmetric `mode` (int8 | fp8: per output channel, its scales reduced over `in_axes`; fp8_block: per
    128 x 128 block) of `kernel`."""
    if mode == "fp8_block":
        return QuantizedKernel(*quantize_blocks(kernel, in_axes), kernel.dtype)
    return QuantizedKernel(*quantize_symmetric(kernel, in_axes, mode), kernel.dtype)


def input_axes(kernel: nnx.Variable, n_in: int) -> tuple[int, ...]:
    """The contracted axes of a projection kernel; a stacked one leads with its `layers` axis."""
    names = kernel.get_metadata().get("out_sharding") or ()
    lead = 1 if names and names[0] == "layers" else 0
    return tuple(range(lead, lead + n_in))


def projection_kernels(graphdef, weights) -> dict[tuple, tuple[int, ...]]:
    """{kernel path in the state: its input axes} of every projection of the model."""
    model = nnx.merge(graphdef, weights)
    return {(*path, "kernel"): input_axes(node.kernel, node.n_in)
            for path, node in nnx.iter_graph(model) if isinstance(node, Projection)}


def quantize_weights(graphdef, weights, mode: str):
    """The rollout's weights with every projection kernel quantized (`mode` int8 | fp8), or as they are (none)."""
    if mode == "none":
        return weights
    kernels = projection_kernels(graphdef, weights)
    flat = dict(nnx.to_flat_state(weights))
    for path, axes in kernels.items():
        flat[path] = flat[path].replace(quantize_kernel(flat[path].get_value(), axes, mode))
    return nnx.from_flat_state(flat)


def abstract_quantized(graphdef, weights, mode: str):
    """What `quantize_weights` makes of abstract `weights` (ShapeDtypeStructs with shardings): each
    kernel's 8-bit values sharded as the kernel, its scales as the kernel's output axes."""
    if mode == "none":
        return weights
    flat = dict(nnx.to_flat_state(weights))
    for path, axes in projection_kernels(graphdef, weights).items():
        flat[path] = flat[path].replace(abstract_kernel(flat[path].get_value(), axes, mode))
    return nnx.from_flat_state(flat)


def abstract_kernel(kernel: jax.ShapeDtypeStruct, in_axes: tuple[int, ...], mode: str) -> QuantizedKernel:
    shapes = jax.eval_shape(functools.partial(quantize_kernel, in_axes=in_axes, mode=mode), kernel)
    sharding = kernel.sharding
    # Per channel: split like the kernel along its output axes; block scales replicated (the training
    # layout's splits need not fall on block edges).
    scale_sharding = NamedSharding(sharding.mesh, scale_spec(sharding.spec, shapes.scale.shape, kernel.shape,
                                                             split_blocks=False))
    return QuantizedKernel(jax.ShapeDtypeStruct(shapes.values.shape, shapes.values.dtype, sharding=sharding),
                           jax.ShapeDtypeStruct(shapes.scale.shape, shapes.scale.dtype, sharding=scale_sharding),
                           kernel.dtype)


def compile_quantize(compiler, graphdef, weights, mode: str) -> None:
    """Records `rollout quantize` for `grpo-run --plan` (a grpo_core PhaseCompiler): the 8-bit copy
    `load_weights` makes from the trained `weights` (abstract, sharded) once per rollout, laid out as
    `abstract_quantized`; the projection prices it with the step. Nothing for mode none."""
    if mode == "none":
        return
    shardings = jax.tree.map(lambda leaf: leaf.sharding, abstract_quantized(graphdef, weights, mode))
    quantize = jax.jit(lambda full: quantize_weights(graphdef, full, mode), out_shardings=shardings)
    compiler.compile("rollout quantize", lambda: quantize.lower(weights).compile(), (weights,),
                     note=f"{mode} projection weights made on device from the trained ones, once per rollout")


def is_quantized(weights) -> bool:
    """Some kernel of `weights` is a QuantizedKernel."""
    return any(isinstance(leaf, QuantizedKernel)
               for leaf in jax.tree.leaves(weights, is_leaf=lambda x: isinstance(x, QuantizedKernel)))


def kv_cache_refusal(options, dtype: str) -> str | None:
    """Why the jax backend's `options` (JaxRolloutOptions) cannot decode on a `dtype` (int8 | fp8) KV
    cache, in one line with the fix, or None."""
    if options.cache_dtype is not None:
        return (f"rollout.kv_cache_dtype={dtype} with rollout.options.cache_dtype={options.cache_dtype}: the {dtype} "
                "cache is read back in model.dtype, so the options' cache dtype would be ignored; set "
                "rollout.options.cache_dtype=null or rollout.kv_cache_dtype=auto.")
    return None
