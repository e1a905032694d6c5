"""Grouped matmul with `jax.lax.ragged_dot` semantics: a Pallas TPU kernel and its VJP.

    out[r] = lhs[r] @ rhs[g]   for each row r of group g;  lhs [M, K], rhs [E, K, N] -> out [M, N]

Groups are consecutive row ranges of `group_sizes` [E] rows each, in order; rows past their sum
belong to no group and give 0 (as ragged_dot).

Tiling (forward, `_gmm`): rows in tiles of `tm` (128 by default; M padded to it), K and N in
blocks of 128-512 columns (padded to multiples of 128). The grid is (N blocks, visits, K blocks):
a visit is one (row tile, group) pair the tile overlaps, listed in row order, so a tile shared by
two groups is visited twice, once with each group's weights. The visit lists are scalar-prefetched
(`_visits`); the rows of a visit outside its group are zeroed before the MXU product, and a row
tile's f32 accumulator stays in VMEM across its visits and K blocks, written out once. The grid
has a static length, tiles + E (the most visits any group sizes need); the steps past the real
visits repeat the last one with no rows, so they neither compute nor fetch new blocks.

VJP: d lhs = the same kernel on dout with each group's weights transposed (contracted on N);
d rhs [E, K, N] = per group lhs_g^T @ dout_g, a second kernel (`_tgmm`) whose grid is
(K blocks, N blocks, visits), every group visited at least once so a group with no rows gets a
zero gradient. The backward multiplies in the operands' dtype: the cotangent is cast to it, which
loses nothing when the forward's result was itself cast to that dtype (as `moe.grouped_swiglu`
does).

`ragged_matmul` picks the kernel when the program is lowered for a TPU and ragged_dot elsewhere.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

LANE = 128  # TPU vector lane width: K and N blocks are multiples of it
BLOCKS = (512, 384, 256, 128)  # K / N block widths tried, widest first
TILE_M = 128  # rows per tile: smaller tiles waste less at group edges (each edge costs one visit)


def ragged_matmul(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *,
                  preferred_element_type=None) -> jax.Array:
    """`jax.lax.ragged_dot` semantics on every platform: the Pallas kernel (`grouped_matmul`) when
    lowered for a TPU, `jax.lax.ragged_dot` on CPU and GPU. `jax.lax.platform_dependent` decides at
    lowering time, not the host's default backend, so a program compiled ahead of time for a TPU
    target from a CPU host (`grpo-run --plan --target`, the TPU-compiler tests) holds the kernel
    too, and no configuration key is needed. Operands XLA would partition over several devices
    (`_partitioned`) take ragged_dot on TPU too: XLA cannot split a Pallas call (inside a shard_map
    over every mesh axis the kernel runs per device)."""
    xla = functools.partial(jax.lax.ragged_dot, preferred_element_type=preferred_element_type)
    if _partitioned(lhs, rhs, group_sizes):
        return xla(lhs, rhs, group_sizes)
    kernel = functools.partial(grouped_matmul, preferred_element_type=preferred_element_type)
    return jax.lax.platform_dependent(lhs, rhs, group_sizes, tpu=kernel, default=xla)


def _partitioned(*operands: jax.Array) -> bool:
    """Whether the context mesh or an operand's mesh (known from a committed or scanned parameter)
    spreads the call over more than one device outside shard_map's manual axes."""
    meshes = [jax.sharding.get_abstract_mesh(), *(jax.typeof(x).sharding.mesh for x in operands)]
    return any(math.prod(size for size, kind in zip(m.axis_sizes, m.axis_types)
                         if kind != jax.sharding.AxisType.Manual) > 1 for m in meshes)


def grouped_matmul(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *, preferred_element_type=None,
                   tile_m: int = TILE_M, interpret=False) -> jax.Array:
    """lhs [M, K], rhs [E, K, N], group_sizes [E] (int) -> [M, N] in `preferred_element_type` (default
    the operands' dtype), accumulated in float32 (module doc). `interpret` (True or a
    `pltpu.InterpretParams`): run the kernel in Pallas' interpreter, on any backend (tests)."""
    if lhs.ndim != 2 or rhs.ndim != 3 or lhs.shape[1] != rhs.shape[1] or group_sizes.shape != rhs.shape[:1]:
        raise ValueError(f"grouped_matmul needs lhs [M, K], rhs [E, K, N], group_sizes [E]; got lhs {lhs.shape}, "
                         f"rhs {rhs.shape}, group_sizes {group_sizes.shape}.")
    dtype = jnp.promote_types(lhs.dtype, rhs.dtype)
    out_dtype = jnp.dtype(preferred_element_type or dtype)
    if lhs.shape[0] == 0:
        return jnp.zeros((0, rhs.shape[2]), out_dtype)
    tm = _row_tile(lhs.shape[0], min(dtype.itemsize, out_dtype.itemsize), tile_m)
    lhs, rhs, group_sizes = _same_varying(lhs.astype(dtype), rhs.astype(dtype), group_sizes.astype(jnp.int32))
    return _grouped_matmul(lhs, rhs, group_sizes, out_dtype, tm, interpret)


def _row_tile(rows: int, itemsize: int, tile_m: int) -> int:
    """The row tile: `tile_m`, or fewer rows when M is smaller, a multiple of the sublane count of
    the narrowest operand or result (8 rows of 32-bit values, 16 of 16-bit ones: a TPU block's
    second-to-last dim)."""
    sublanes = 8 * max(1, 4 // itemsize)
    if tile_m <= 0 or tile_m % sublanes:
        raise ValueError(f"grouped_matmul: tile_m={tile_m} must be a positive multiple of {sublanes} for "
                         f"{8 * itemsize}-bit rows; use e.g. {TILE_M}.")
    return min(tile_m, -(-rows // sublanes) * sublanes)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _grouped_matmul(lhs, rhs, group_sizes, out_dtype, tm, interpret):
    return _gmm(lhs, rhs, group_sizes, out_dtype, tm, False, interpret)


def _grouped_matmul_fwd(lhs, rhs, group_sizes, out_dtype, tm, interpret):
    return _gmm(lhs, rhs, group_sizes, out_dtype, tm, False, interpret), (lhs, rhs, group_sizes)


def _grouped_matmul_bwd(out_dtype, tm, interpret, residuals, dout):
    lhs, rhs, group_sizes = residuals
    dout = dout.astype(lhs.dtype)  # module doc: the backward multiplies in the operands' dtype
    d_lhs = _gmm(dout, rhs, group_sizes, lhs.dtype, tm, True, interpret)  # [M, N] x [E, K, N]^T
    d_rhs = _tgmm(lhs, dout, group_sizes, rhs.dtype, tm, interpret)
    return d_lhs, d_rhs, None


_grouped_matmul.defvjp(_grouped_matmul_fwd, _grouped_matmul_bwd)


def _visits(group_sizes: jax.Array, rows: int, tm: int, every_group: bool):
    """The grid's visits in row order: (row tile, group, first row, end row) int32 [tiles + E] each.
    A group visits each row tile it overlaps, its rows [first, end). `every_group` (d rhs): a group
    with no rows still gets one visit, with no rows, so its output block is written (zeros); else
    (the forward) empty groups are skipped and a last span with no rows covers the tiles past the
    groups' sum, so every row tile is written. Steps past the real visits repeat the last one with
    no rows."""
    e, tiles = group_sizes.shape[0], -(-rows // tm)
    ends = jnp.minimum(jnp.cumsum(group_sizes), rows)  # rows past `rows` belong to no group
    starts = jnp.concatenate([jnp.zeros(1, jnp.int32), ends[:-1]])
    lo, hi, span_end, group = starts, ends, ends, jnp.arange(e, dtype=jnp.int32)
    if not every_group:
        tail = ends[-1:]
        lo, hi = jnp.concatenate([lo, tail]), jnp.concatenate([hi, tail])
        starts, span_end = jnp.concatenate([starts, tail]), jnp.concatenate([ends, jnp.full(1, tiles * tm)])
        group = jnp.concatenate([group, jnp.full(1, e - 1, jnp.int32)])  # any weights: it has no rows
    first_tile = jnp.minimum(starts // tm, tiles - 1)
    spans = jnp.where(span_end > starts, (span_end - 1) // tm - starts // tm + 1, int(every_group))
    cumulative = jnp.cumsum(spans)
    step = jnp.arange(tiles + e, dtype=jnp.int32)
    real = step < cumulative[-1]
    step = jnp.minimum(step, cumulative[-1] - 1)
    span = jnp.searchsorted(cumulative, step, side="right")
    tile = first_tile[span] + step - (cumulative[span] - spans[span])
    return (tile.astype(jnp.int32), group[span], jnp.where(real, lo[span], 0).astype(jnp.int32),
            jnp.where(real, hi[span], 0).astype(jnp.int32))


def _block(width: int) -> int:
    return next(b for b in BLOCKS if width % b == 0)


def _pad(x: jax.Array, multiples: tuple[int, ...]) -> jax.Array:
    """x zero-padded at the end of its last len(multiples) dims to those multiples."""
    lead = x.ndim - len(multiples)
    widths = [(0, 0)] * lead + [(0, -size % m) for size, m in zip(x.shape[lead:], multiples)]
    return jnp.pad(x, widths) if any(w for _, w in widths) else x


def _group_rows(x: jax.Array, tile, lo, hi) -> jax.Array:
    """A row tile [tm, W] with the rows outside [lo, hi) zeroed (they belong to other groups)."""
    row = tile * x.shape[0] + jax.lax.broadcasted_iota(jnp.int32, x.shape, 0)
    return jnp.where((row >= lo) & (row < hi), x, jnp.zeros_like(x))


def _first_last(keys, axis: int):
    """Whether this grid step's visit is the first / the last of its output block: the visits of one
    block are consecutive, keyed by row tile (forward) or group (d rhs)."""
    v, last_step = pl.program_id(axis), pl.num_programs(axis) - 1
    first = (v == 0) | (keys[jnp.maximum(v - 1, 0)] != keys[v])
    return first, (v == last_step) | (keys[jnp.minimum(v + 1, last_step)] != keys[v])


def _gmm_kernel(tiles, groups, lo, hi, lhs_ref, rhs_ref, out_ref, acc_ref, *, transpose_rhs):
    v, k = pl.program_id(1), pl.program_id(2)
    first, last = _first_last(tiles, 1)

    @pl.when(first & (k == 0))
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    @pl.when(lo[v] < hi[v])
    def _():
        x = _group_rows(lhs_ref[...], tiles[v], lo[v], hi[v])
        contract = ((1,), (1,)) if transpose_rhs else ((1,), (0,))
        acc_ref[...] += jax.lax.dot_general(x, rhs_ref[...], (contract, ((), ())), preferred_element_type=jnp.float32)

    @pl.when(last & (k == pl.num_programs(2) - 1))
    def _():
        out_ref[...] = acc_ref[...].astype(out_ref.dtype)


def _gmm(lhs, rhs, group_sizes, out_dtype, tm, transpose_rhs, interpret):
    """lhs [M, C] by each group's rhs [E, C, W] (`transpose_rhs`: [E, W, C]) -> [M, W] in out_dtype."""
    out_axis = 1 if transpose_rhs else 2
    rows, width = lhs.shape[0], rhs.shape[out_axis]
    lhs, rhs = _pad(lhs, (tm, LANE)), _pad(rhs, (LANE, LANE))
    tc, tw = _block(lhs.shape[1]), _block(rhs.shape[out_axis])
    visits = _visits(group_sizes, rows, tm, every_group=False)

    def rhs_index(j, v, i, tiles, groups, *_):
        return (groups[v], j, i) if transpose_rhs else (groups[v], i, j)

    spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=4, grid=(rhs.shape[out_axis] // tw, visits[0].shape[0], lhs.shape[1] // tc),
        in_specs=[pl.BlockSpec((tm, tc), lambda j, v, i, tiles, *_: (tiles[v], i)),
                  pl.BlockSpec((pl.squeezed, tw, tc) if transpose_rhs else (pl.squeezed, tc, tw), rhs_index)],
        out_specs=pl.BlockSpec((tm, tw), lambda j, v, i, tiles, *_: (tiles[v], j)),
        scratch_shapes=[pltpu.VMEM((tm, tw), jnp.float32)])
    out = pl.pallas_call(
        functools.partial(_gmm_kernel, transpose_rhs=transpose_rhs), grid_spec=spec, name="grouped_matmul",
        out_shape=_varying_like((lhs.shape[0], rhs.shape[out_axis]), out_dtype, lhs, rhs, group_sizes),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary", "arbitrary")),
        interpret=interpret)(*visits, lhs, rhs)
    return out[:rows, :width]


def _varying_like(shape: tuple, dtype, *operands: jax.Array) -> jax.ShapeDtypeStruct:
    """The kernel's output shape, varying over the manual mesh axes its operands vary over (made the same
    by `_same_varying`): inside a shard_map that checks it (check_vma, e.g. the expert-parallel MoE)
    a Pallas call must say so."""
    return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=jax.typeof(operands[0]).manual_axis_type)


def _same_varying(*operands: jax.Array) -> tuple[jax.Array, ...]:
    """`operands` cast to vary over every manual mesh axis one of them varies over, before the custom
    VJP: each cotangent then matches its operand, and the cast's transpose sums a weight's gradient
    over the axes its tokens vary over (outside shard_map: unchanged)."""
    varying = [jax.typeof(x).manual_axis_type.varying for x in operands]
    every = frozenset().union(*varying)
    return tuple(jax.lax.pcast(x, tuple(sorted(every - own)), to="varying") for x, own in zip(operands, varying))


def _tgmm_kernel(tiles, groups, lo, hi, lhs_ref, dout_ref, out_ref, acc_ref):
    v = pl.program_id(2)
    first, last = _first_last(groups, 2)

    @pl.when(first)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    @pl.when(lo[v] < hi[v])
    def _():
        x = _group_rows(lhs_ref[...], tiles[v], lo[v], hi[v])
        acc_ref[...] += jax.lax.dot_general(x, dout_ref[...], (((0,), (0,)), ((), ())),
                                            preferred_element_type=jnp.float32)

    @pl.when(last)
    def _():
        out_ref[...] = acc_ref[...].astype(out_ref.dtype)


def _tgmm(lhs, dout, group_sizes, out_dtype, tm, interpret):
    """Per group lhs_g^T @ dout_g: lhs [M, K], dout [M, N] -> [E, K, N] in out_dtype (0 for empty groups)."""
    (rows, k), n, e = lhs.shape, dout.shape[1], group_sizes.shape[0]
    lhs, dout = _pad(lhs, (tm, LANE)), _pad(dout, (tm, LANE))
    tk, tn = _block(lhs.shape[1]), _block(dout.shape[1])
    visits = _visits(group_sizes, rows, tm, every_group=True)
    spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=4, grid=(lhs.shape[1] // tk, dout.shape[1] // tn, visits[0].shape[0]),
        in_specs=[pl.BlockSpec((tm, tk), lambda i, j, v, tiles, *_: (tiles[v], i)),
                  pl.BlockSpec((tm, tn), lambda i, j, v, tiles, *_: (tiles[v], j))],
        out_specs=pl.BlockSpec((pl.squeezed, tk, tn), lambda i, j, v, tiles, groups, *_: (groups[v], i, j)),
        scratch_shapes=[pltpu.VMEM((tk, tn), jnp.float32)])
    out = pl.pallas_call(
        _tgmm_kernel, grid_spec=spec, name="grouped_matmul_transposed",
        out_shape=_varying_like((e, lhs.shape[1], dout.shape[1]), out_dtype, lhs, dout, group_sizes),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=interpret)(*visits, lhs, dout)
    return out[:, :k, :n]
