"""`pallas` implementation: Pallas kernels for the forward softmax state and the
two backward products, wrapped in the shared custom_vjp (`vocab_parallel`).

Kernels (grid order = loop order, reduction axis last):
  stats  grid (token blocks, vocab blocks): online log-sum-exp state per token.
  d_h    grid (token blocks, vocab blocks): recompute z, accumulate dz @ w^T.
  d_w    grid (vocab blocks, token blocks): recompute z, accumulate h^T @ dz.
Two backward kernels instead of one because a TPU output block must stay
resident while it is accumulated: d_h is reduced over vocab, d_w over tokens.

No one-pass gradient here (the `fused` implementation has one): it needs a token
block's complete logits row before dz exists (the log-sum-exp spans every vocab
block), and a [rows, V] float32 row does not fit in VMEM next to the weight
tiles at useful sizes (rows=8 at V=151936 is 4.6 MiB, and the d_w accumulator
must stay resident per vocab block, which a token-major grid cannot give).
`grpo_loss` therefore runs this implementation in two passes for every config.

Targets: TPU (Mosaic) compiled, and CPU with `interpret=True` (chosen
automatically on the cpu backend). There is no GPU (Triton) variant: on GPU use
`fused`, or set `interpret: true` to run these kernels through the interpreter.

Ragged edges are masked in-kernel rather than padded in HBM: the last vocab
block zeroes out-of-range weight columns and gives them logit -inf; the d_w
kernel zeroes out-of-range token rows (whose inputs hold undefined data).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from grpo_core.errors import UserError

from grpo_losses.blockmath import F32, TokenStats, VocabStats, column_ids, logits_grad, online_update, target_hits
from grpo_losses.logps import Array, TokenLogps
from grpo_losses.vocab_parallel import blockwise_token_logps

LANES = 128  # TPU vector lane count: the last block dim must be a multiple
SUBLANE_BYTES = 32  # 8 sublanes x 4 bytes: rows per tile = 32 / itemsize (8 f32, 16 bf16)
NT = (((1,), (1,)), ((), ()))  # dot_general: contract the last dims (a @ b^T)
TN = (((0,), (0,)), ((), ()))  # dot_general: contract the first dims (a^T @ b)


@dataclass(frozen=True)
class PallasOptions:
    """`loss.options` of the `pallas` implementation."""

    # 256 x 256 tiles keep a double-buffered f32 step at H=2048 (h, w and the
    # d_w accumulator, 2 MiB each) inside the 16 MiB default TPU scoped VMEM.
    block_size: int = 256
    time_block: int = 256
    interpret: bool | None = None  # None: interpret exactly when the default backend is cpu
    vocab_axis: str = "tp"  # mesh axis that splits lm_head's V dim

    def __post_init__(self) -> None:
        if not isinstance(self.block_size, int) or self.block_size < 1 or self.block_size % LANES:
            raise ValueError(f"pallas loss option block_size must be a positive multiple of {LANES} "
                             f"(TPU lane width), got {self.block_size!r}")
        if not isinstance(self.time_block, int) or self.time_block < 1 or self.time_block % 8:
            raise ValueError(f"pallas loss option time_block must be a positive multiple of 8 (16 for "
                             f"bfloat16 hidden states), got {self.time_block!r}")


class BlockShapeError(UserError, ValueError):
    """A block of the pallas loss that a TPU cannot tile: a bad `loss.options` value."""


def min_block_rows(dtype) -> int:
    """Rows of one TPU tile for `dtype`: 8 for 32-bit, 16 for 16-bit, 32 for 8-bit."""
    return max(8, SUBLANE_BYTES // np.dtype(dtype).itemsize)


def validate_block_shape(name: str, block: Sequence[int], shape: Sequence[int], dtype) -> None:
    """Raise ValueError unless `block` tiles an array of `shape`/`dtype` legally on TPU:
    each of the last two block dims equals the array dim or is a multiple of
    (rows per tile, 128)."""
    rows, lanes = block[-2], block[-1]
    need_rows = min_block_rows(dtype)
    if rows != shape[-2] and rows % need_rows:
        raise BlockShapeError(
            f"pallas loss: block {tuple(block)} of {name} {tuple(shape)} {np.dtype(dtype).name} has {rows} rows, "
            f"not a multiple of {need_rows} (TPU tile rows for this dtype) nor the full {shape[-2]}; "
            f"set loss.options.time_block to a multiple of {need_rows}")
    if lanes != shape[-1] and lanes % LANES:
        raise BlockShapeError(
            f"pallas loss: block {tuple(block)} of {name} {tuple(shape)} has {lanes} columns, not a multiple "
            f"of {LANES} (TPU lanes) nor the full {shape[-1]}; set loss.options.block_size to a multiple of {LANES}")


@dataclass(frozen=True)
class PallasKernels:
    """Pallas `VocabKernels` (see `grpo_losses.vocab_parallel`)."""

    block_size: int
    time_block: int
    interpret: bool

    def stats(self, h: Array, w: Array, targets: Array, inv_temp: Array, with_entropy: bool) -> VocabStats:
        grid = _Grid.of(self, h, w)
        order = grid.token_major()
        n_out = 4 if with_entropy else 3
        kernel = functools.partial(_stats_kernel, vocab=grid.vocab, cols=grid.cols)
        in_specs = [grid.rows_spec(order, 1), grid.rows_spec(order, h.shape[1]), grid.cols_spec(order, w.shape[0])]
        out = self._call(kernel, order, [_column_out(h)] * n_out, [grid.rows_spec(order, 1)] * n_out,
                         inv_temp, (targets, h, w), in_specs)
        return VocabStats(*out) if with_entropy else VocabStats(*out, None)

    def grads(self, h: Array, w: Array, targets: Array, inv_temp: Array, stats: TokenStats,
              g_lp: Array, g_ent: Array | None) -> tuple[Array, Array]:
        grid = _Grid.of(self, h, w)
        per_token = [stats.lse, g_lp] + ([] if g_ent is None else [stats.mean_logit, g_ent])
        rows = jnp.concatenate([x.astype(F32) for x in per_token], axis=1)  # [N, 2 or 4]
        operands = (targets, rows, h, w)
        dh_kernel = functools.partial(_dh_kernel, vocab=grid.vocab, cols=grid.cols)
        dh = self._call(dh_kernel, grid.token_major(), [jax.ShapeDtypeStruct(h.shape, F32)],
                        [grid.rows_spec(grid.token_major(), h.shape[1])], inv_temp, operands,
                        grid.grad_in_specs(grid.token_major(), rows.shape[1], h, w))[0]
        dw_kernel = functools.partial(_dw_kernel, vocab=grid.vocab, cols=grid.cols,
                                      n_tokens=grid.n_tokens, rows=grid.rows)
        dw = self._call(dw_kernel, grid.vocab_major(), [jax.ShapeDtypeStruct(w.shape, F32)],
                        [grid.cols_spec(grid.vocab_major(), w.shape[0])], inv_temp, operands,
                        grid.grad_in_specs(grid.vocab_major(), rows.shape[1], h, w))[0]
        return dh, dw

    def _call(self, kernel, order: _Order, out_shape, out_specs, inv_temp, arrays, in_specs):
        """pallas_call with the temperature as a (1, 1) block first, after checking every block."""
        operands = (inv_temp.reshape(1, 1).astype(F32),) + tuple(arrays)
        in_specs = [pl.BlockSpec((1, 1), order.fixed)] + list(in_specs)
        for spec, x in zip(in_specs + out_specs, operands + tuple(out_shape)):
            validate_block_shape(_operand_name(x), spec.block_shape, x.shape, x.dtype)
        return pl.pallas_call(kernel, out_shape=out_shape, grid=order.grid, in_specs=in_specs,
                              out_specs=out_specs, interpret=self.interpret,
                              compiler_params=None if self.interpret else _tpu_params())(*operands)


def _operand_name(x) -> str:
    return f"operand {x.dtype}{list(x.shape)}"


def _column_out(h: Array) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct((h.shape[0], 1), F32)


def _tpu_params():
    from jax.experimental.pallas import tpu as pltpu

    return pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"))


@dataclass(frozen=True)
class _Order:
    """A grid and the index maps of the two loop variables in that grid."""

    grid: tuple[int, int]
    token_index: int  # which grid axis walks token blocks

    def tokens(self, *ids):
        return ids[self.token_index]

    def vocab(self, *ids):
        return ids[1 - self.token_index]

    def fixed(self, *ids):
        return 0, 0


@dataclass(frozen=True)
class _Grid:
    """Block sizes for one call: rows x cols tiles over tokens x this shard's vocab."""

    n_tokens: int
    vocab: int
    rows: int
    cols: int

    @classmethod
    def of(cls, kernels: PallasKernels, h: Array, w: Array) -> _Grid:
        n_tokens, vocab = h.shape[0], w.shape[1]
        return cls(n_tokens, vocab, min(kernels.time_block, n_tokens), min(kernels.block_size, vocab))

    def token_major(self) -> _Order:
        return _Order((pl.cdiv(self.n_tokens, self.rows), pl.cdiv(self.vocab, self.cols)), 0)

    def vocab_major(self) -> _Order:
        return _Order((pl.cdiv(self.vocab, self.cols), pl.cdiv(self.n_tokens, self.rows)), 1)

    def rows_spec(self, order: _Order, width: int) -> pl.BlockSpec:
        """A [N, width] per-token array, one block of rows per token step."""
        return pl.BlockSpec((self.rows, width), lambda *ids: (order.tokens(*ids), 0))

    def cols_spec(self, order: _Order, height: int) -> pl.BlockSpec:
        """A [height, V] array (weight or its gradient), one block of columns per vocab step."""
        return pl.BlockSpec((height, self.cols), lambda *ids: (0, order.vocab(*ids)))

    def grad_in_specs(self, order: _Order, n_stats: int, h: Array, w: Array) -> list[pl.BlockSpec]:
        """Specs of (targets, per-token stats, h, w) for the backward kernels."""
        return [self.rows_spec(order, 1), self.rows_spec(order, n_stats), self.rows_spec(order, h.shape[1]),
                self.cols_spec(order, w.shape[0])]


def _stats_kernel(inv_ref, targets_ref, h_ref, w_ref, *state_refs, vocab: int, cols: int):
    j = pl.program_id(1)

    @pl.when(j == 0)
    def _init():
        rows, with_entropy = state_refs[0].shape[0], len(state_refs) == 4
        for ref, value in zip(state_refs, VocabStats.empty(rows, with_entropy)):
            ref[...] = value

    valid = column_ids(j * cols, cols) < vocab  # [1, cols]
    w = jnp.where(valid, w_ref[...], 0)  # out-of-range columns hold undefined data
    z = jnp.where(valid, _dot(h_ref[...], w) * inv_ref[...], -jnp.inf)  # [rows, cols]
    acc = VocabStats(*(ref[...] for ref in state_refs))
    for ref, value in zip(state_refs, online_update(acc, z, target_hits(targets_ref[...], j * cols, cols))):
        ref[...] = value


def _dh_kernel(inv_ref, targets_ref, rows_ref, h_ref, w_ref, dh_ref, *, vocab: int, cols: int):
    j = pl.program_id(1)

    @pl.when(j == 0)
    def _init():
        dh_ref[...] = jnp.zeros(dh_ref.shape, F32)

    dz, w = _block_dlogits(inv_ref, targets_ref, rows_ref, h_ref[...], w_ref[...], j * cols, cols, vocab)
    dh_ref[...] += jax.lax.dot_general(dz.astype(w.dtype), w, NT, preferred_element_type=F32)


def _dw_kernel(inv_ref, targets_ref, rows_ref, h_ref, w_ref, dw_ref, *, vocab: int, cols: int,
               n_tokens: int, rows: int):
    j, i = pl.program_id(0), pl.program_id(1)

    @pl.when(i == 0)
    def _init():
        dw_ref[...] = jnp.zeros(dw_ref.shape, F32)

    valid_rows = i * rows + jax.lax.broadcasted_iota(jnp.int32, (rows, 1), 0) < n_tokens  # [rows, 1]
    h = jnp.where(valid_rows, h_ref[...], 0)  # out-of-range rows hold undefined data
    dz, _ = _block_dlogits(inv_ref, targets_ref, rows_ref, h, w_ref[...], j * cols, cols, vocab)
    dz = jnp.where(valid_rows, dz, 0.0)
    dw_ref[...] += jax.lax.dot_general(h, dz.astype(h.dtype), TN, preferred_element_type=F32)


def _block_dlogits(inv_ref, targets_ref, rows_ref, h, w, start, cols: int, vocab: int):
    """(dL/d(h . w) [rows, cols] zeroed outside the vocab, the masked weight block)."""
    valid = column_ids(start, cols) < vocab  # [1, cols]
    w = jnp.where(valid, w, 0)
    z = _dot(h, w) * inv_ref[...]  # [rows, cols]; finite everywhere as w is zeroed
    per_token = rows_ref[...]
    lse, g_lp = per_token[:, 0:1], per_token[:, 1:2]
    mean_logit, g_ent = (per_token[:, 2:3], per_token[:, 3:4]) if per_token.shape[1] == 4 else (None, None)
    hits = target_hits(targets_ref[...], start, cols)
    dz = logits_grad(z, hits, lse, g_lp, mean_logit, g_ent, inv_ref[...])
    return jnp.where(valid, dz, 0.0), w


def _dot(a: Array, b: Array) -> Array:
    return jnp.dot(a, b, preferred_element_type=F32)


@dataclass(frozen=True)
class PallasLogps:
    """The `pallas` TokenLogpsImpl.

    Mosaic kernels cannot be partitioned by the compiler: on a multi-device mesh they run
    per device inside shard_map, on the mesh bound with `on_mesh` (the run binds its own),
    else the call's `mesh`, else the context mesh. The bound mesh's devices also decide
    Mosaic vs interpret mode, so a plan for TPU devices from a CPU host lowers Mosaic.
    """

    options: PallasOptions = PallasOptions()
    mesh: Any = None

    def on_mesh(self, mesh: Any) -> "PallasLogps":
        return dataclasses.replace(self, mesh=mesh)

    def __call__(self, hidden: Array, lm_head: Array, targets: Array, temperature: float | Array = 1.0,
                 *, entropy: bool = False, mesh=None) -> TokenLogps:
        kernels = PallasKernels(self.options.block_size, self.options.time_block, self._interpret())
        return blockwise_token_logps(kernels, hidden, lm_head, targets, temperature, entropy=entropy,
                                     vocab_axis=self.options.vocab_axis, mesh=self.mesh if mesh is None else mesh)

    def _interpret(self) -> bool:
        backend = jax.default_backend() if self.mesh is None else self.mesh.devices.flat[0].platform
        if self.options.interpret is not None:
            interpret = self.options.interpret
        else:
            interpret = backend == "cpu"
        if not interpret and backend != "tpu":
            raise ValueError(
                f"the pallas loss has TPU (Mosaic) kernels only, but the backend is {backend!r}; "
                "use loss.impl: fused, or set loss.options.interpret: true to run the kernels interpreted")
        return interpret


def build_pallas(options: PallasOptions) -> PallasLogps:
    """`LossSpec.factory` of the `pallas` implementation."""
    return PallasLogps(options)
