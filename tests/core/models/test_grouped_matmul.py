"""The grouped-matmul Pallas kernel (grpo_core.models.grouped_matmul) against `jax.lax.ragged_dot`:
values and both cotangents in Pallas' interpreter on CPU, and its Mosaic lowering by the TPU
compiler (compile-only v6e devices, skipped without libtpu).

Tolerance: float32; the kernel sums the same products in another order (K blocks, f32
accumulator), so results agree to 1e-5 relative to the reference's largest magnitude (observed:
0 to 6.3e-7).
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from grpo_core.models.grouped_matmul import grouped_matmul, ragged_matmul
from grpo_core.models.moe import grouped_swiglu
from jax.experimental.pallas import tpu as pltpu

RTOL = 1e-5
ROWS = 200  # not a multiple of any row tile used below
PATTERNS = {  # group sizes over ROWS rows, row tile 32 (7 tiles)
    "empty_groups": [0, 50, 0, 3, 0, 100, 47, 0],
    "one_group_spans_all_tiles": [0, 200, 0, 0],
    "groups_share_tiles": [3, 5, 7, 1, 90, 30, 60, 4],
    "rows_past_the_sum": [10, 0, 40, 30],  # rows 80.. belong to no group: output 0, no gradient
}


def _inputs(groups, k, n, seed=0, dtype=jnp.float32, rows=ROWS):
    rng = np.random.default_rng(seed)
    lhs = jnp.asarray(rng.normal(size=(rows, k)), dtype)
    rhs = jnp.asarray(rng.normal(size=(len(groups), k, n)), dtype)
    weight = jnp.asarray(rng.normal(size=(rows, n)), jnp.float32)  # the loss's cotangent
    return lhs, rhs, jnp.asarray(groups, jnp.int32), weight


# The TPU interpreter: memory a kernel leaves unwritten reads NaN, out-of-bounds reads raise.
INTERPRET = pltpu.InterpretParams(uninitialized_memory="nan", out_of_bounds_reads="raise")


def _kernel(tile_m=32):
    return functools.partial(grouped_matmul, preferred_element_type=jnp.float32, tile_m=tile_m, interpret=INTERPRET)


def _reference(lhs, rhs, group_sizes):
    return jax.lax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=jnp.float32)


def _value_and_grads(matmul, lhs, rhs, group_sizes, weight):
    loss = lambda a, b: jnp.sum(matmul(a, b, group_sizes) * weight)  # noqa: E731
    return jax.jit(lambda a, b: (matmul(a, b, group_sizes), jax.grad(loss, argnums=(0, 1))(a, b)))(lhs, rhs)


def _relative_error(got, want) -> float:
    return float(np.abs(np.asarray(got) - np.asarray(want)).max() / np.abs(np.asarray(want)).max())


@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_values_and_gradients_match_ragged_dot(pattern):
    args = _inputs(PATTERNS[pattern], 256, 128)
    out, (d_lhs, d_rhs) = _value_and_grads(_kernel(), *args)
    want, (want_lhs, want_rhs) = _value_and_grads(_reference, *args)
    for got, ref in ((out, want), (d_lhs, want_lhs), (d_rhs, want_rhs)):
        assert _relative_error(got, ref) <= RTOL
    rows = sum(PATTERNS[pattern])
    assert not np.asarray(out[rows:]).any() and not np.asarray(d_lhs[rows:]).any()
    empty = np.asarray(PATTERNS[pattern]) == 0
    assert not np.asarray(d_rhs)[empty].any()  # a group with no rows gets a zero gradient


@pytest.mark.parametrize("k, n, tile_m", [(200, 72, 64), (640, 384, 128)])
def test_padded_and_multi_block_widths(k, n, tile_m):
    """K, N not multiples of 128 (zero-padded), and several K / N blocks (640 = 5 x 128, 384 = 3 x 128
    in one block)."""
    args = _inputs(PATTERNS["groups_share_tiles"], k, n, seed=1)
    out, grads = _value_and_grads(_kernel(tile_m), *args)
    want, want_grads = _value_and_grads(_reference, *args)
    assert out.shape == want.shape and grads[1].shape == want_grads[1].shape
    for got, ref in zip((out, *grads), (want, *want_grads)):
        assert _relative_error(got, ref) <= RTOL


def test_bfloat16_operands_accumulate_in_float32():
    lhs, rhs, group_sizes, _ = _inputs(PATTERNS["empty_groups"], 128, 128, dtype=jnp.bfloat16)
    got = jax.jit(_kernel())(lhs, rhs, group_sizes)
    assert got.dtype == jnp.float32
    assert _relative_error(got, _reference(lhs, rhs, group_sizes)) <= RTOL  # exact products, f32 sums


def test_row_tile_must_fit_the_dtype():
    lhs, rhs, group_sizes, _ = _inputs([ROWS], 128, 128, dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="tile_m=24 must be a positive multiple of 16 for 16-bit rows"):
        grouped_matmul(lhs, rhs, group_sizes, tile_m=24, interpret=True)


def _block_shapes(jaxpr):
    """(block dims, dtype) of every operand and result block of the pallas_calls in `jaxpr`."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            for mapping in eqn.params["grid_mapping"].block_mappings:
                yield [getattr(d, "block_size", None) for d in mapping.block_shape], mapping.array_aval.dtype
        for param in eqn.params.values():
            inner = getattr(param, "jaxpr", param)
            if hasattr(inner, "eqns"):
                yield from _block_shapes(inner)


@pytest.mark.parametrize("dtype, tile_m, rows", [(jnp.bfloat16, 128, 200), (jnp.bfloat16, 128, 20),
                                                 (jnp.bfloat16, 48, 200), (jnp.float32, 8, 200)])
def test_blocks_fit_tpu_tiles(dtype, tile_m, rows):
    """Interpretation does not check TPU block rules, so this does: in the forward and both backward
    kernels every block's last dim is a multiple of 128 lanes and its second-to-last one a multiple
    of the sublanes (8 rows of 32 bits, 16 of 16 bits), also when M is below the row tile."""
    lhs, rhs, group_sizes, _ = _inputs([rows // 3, 0, rows - rows // 3], 200, 72, dtype=dtype, rows=rows)
    kernel = functools.partial(grouped_matmul, preferred_element_type=jnp.float32, tile_m=tile_m, interpret=True)
    loss = lambda a, b: jnp.sum(kernel(a, b, group_sizes))  # noqa: E731
    blocks = list(_block_shapes(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(lhs, rhs).jaxpr))
    assert len(blocks) == 9  # 3 kernels x (2 operands + 1 result)
    for dims, block_dtype in blocks:
        assert None not in dims[-2:] and dims[-1] % 128 == 0, dims
        assert dims[-2] % (8 * 4 // jnp.dtype(block_dtype).itemsize) == 0, (dims, block_dtype)


def test_ragged_matmul_is_ragged_dot_off_tpu():
    """Lowered for the CPU, the selector holds no kernel and gives ragged_dot's values and gradients."""
    args = _inputs(PATTERNS["groups_share_tiles"], 128, 128)
    matmul = functools.partial(ragged_matmul, preferred_element_type=jnp.float32)
    assert "tpu_custom_call" not in jax.jit(matmul).lower(*args[:3]).as_text()
    got, want = _value_and_grads(matmul, *args), _value_and_grads(_reference, *args)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), got, want)


def _kernel_calls(hlo: str, name: str) -> int:
    return len(re.findall(rf"%{name}(\.\d+)? = \S+ custom-call\(.*custom_call_target=\"tpu_custom_call\"", hlo))


MOE_SHAPES = (100, 256, 384, 4, 2)  # tokens, hidden, expert columns, experts, top-k


def _moe_gradient_hlo(sharding, per_device=None) -> str:
    """The TPU compiler's program for the MoE MLP's gradient in bfloat16 (grouped_swiglu), its operands
    placed by `sharding` (a `jax.sharding.Sharding` per operand); `per_device`: run it in this
    shard_map (a mesh) with the tokens split over its one axis."""
    tokens, hidden, mlp, experts, top_k = MOE_SHAPES

    def loss(x, gate, up, down, chosen):
        return jnp.sum(grouped_swiglu(x, chosen, gate, up, down).astype(jnp.float32))

    grad = jax.grad(loss, argnums=(0, 1, 2, 3))
    if per_device is not None:
        split, whole = jax.sharding.PartitionSpec(per_device.axis_names), jax.sharding.PartitionSpec()
        grad = jax.shard_map(grad, mesh=per_device, in_specs=(split, whole, whole, whole, split),
                             out_specs=(split, whole, whole, whole), check_vma=False)
    shapes = [(tokens, hidden), (experts, hidden, mlp), (experts, hidden, mlp), (experts, mlp, hidden)]
    args = [jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=s) for shape, s in zip(shapes, sharding)]
    args.append(jax.ShapeDtypeStruct((tokens, top_k), jnp.int32, sharding=sharding[0]))
    return jax.jit(grad).lower(*args).compile().as_text()


def test_grouped_matmul_kernels_compile_for_tpu(tpu_devices):
    """The MoE MLP's gradient on one v6e chip: both kernels lowered by Mosaic and compiled by the TPU
    compiler, 200 rows (100 tokens x 2 experts: a partial row tile)."""
    hlo = _moe_gradient_hlo([jax.sharding.SingleDeviceSharding(tpu_devices[0])] * 4)
    # forward gate and up (down's output is not needed for the gradient), d lhs of all three; d rhs of all three
    assert _kernel_calls(hlo, "grouped_matmul") == 5
    assert _kernel_calls(hlo, "grouped_matmul_transposed") == 3
    assert "ragged-dot" not in hlo  # not XLA's own ragged_dot lowering


def test_grouped_matmul_on_a_tpu_mesh(tpu_devices):
    """Over 4 v6e chips: operands XLA partitions (FSDP-sharded weights) take XLA's ragged_dot, which it
    can split (a Pallas call it cannot: the compile would fail); inside a shard_map over the mesh the
    kernels run per device on each chip's tokens (25 tokens: 50 rows)."""
    mesh = jax.sharding.Mesh(np.array(tpu_devices), ("fsdp",))
    specs = [("fsdp",), (None, "fsdp"), (None, "fsdp"), (None, None, "fsdp")]
    hlo = _moe_gradient_hlo([jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*s)) for s in specs])
    assert "ragged-dot" in hlo and _kernel_calls(hlo, "grouped_matmul") == 0
    batch = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("fsdp"))
    hlo = _moe_gradient_hlo([batch] + [jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())] * 3, mesh)
    assert _kernel_calls(hlo, "grouped_matmul") == 5 and _kernel_calls(hlo, "grouped_matmul_transposed") == 3
