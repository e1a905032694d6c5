"""`fused` implementation: pure JAX, blocked over tokens and vocab, never builds
[B, T, V] logits; runs on every backend.

Loops: tokens in blocks of `time_block` (outer) x vocab in blocks of
`block_size` (inner). The forward keeps only the online softmax state per token
(see `grpo_losses.blockmath`). The backward recomputes each [time_block,
block_size] logits block, accumulates d hidden for the token block in a small
carry and adds h^T dz into the [H, V] d lm_head buffer in place, so the live
memory is the gradient outputs plus a few logits blocks. Ragged ends need no
padding: the last block of each loop overlaps the previous one and masks what
was already covered (see `blockmath.fold_blocks`).

One-pass loss (`one_pass: true`, used by `grpo_loss` for token-level ratios): the
gradient of a per-token loss w.r.t. a token's logp is known as soon as its
log-sum-exp is, so under differentiation the forward walks token blocks of
`one_pass_time_block` rows, builds each block's full [rows, V] logits once, takes
the exact softmax statistics, the per-token cotangents, dz, and from the same dz
both d hidden and d lm_head: three LM-head matmuls per update (logits, d hidden,
d lm_head) instead of four (forward statistics, recomputed logits, d hidden,
d lm_head). The backward only scales the stored gradients by the numerator's
cotangent. Memory: one [rows, V] logits block and its dz instead of
[time_block, block_size] tiles.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from grpo_losses.blockmath import (
    F32,
    TokenStats,
    VocabStats,
    finish_stats,
    fold_blocks,
    fresh,
    logits_grad,
    online_update,
    target_hits,
)
from grpo_losses.logps import Array, TokenLogps
from grpo_losses.vocab_parallel import blockwise_loss_numerator, blockwise_token_logps


@dataclass(frozen=True)
class FusedOptions:
    """`loss.options` of the `fused` implementation."""

    # 1024 tokens x 2048 columns (an 8 MiB float32 logits block): CPU time at
    # B=2, T=512, V=151936, H=512 was flat (within 10%) from 1024 to 8192 columns and
    # 256 to 1024 tokens; this end keeps the B=8, T=2048, H=2048 temp far below 256 MiB.
    block_size: int = 2048
    time_block: int = 1024
    # One-pass loss (see module doc): tokens per block whose full [rows, V] float32
    # logits and dz stay live (2 x 74 MiB at V=151936, inside the 256 MiB budget of
    # B=8, T=2048, H=2048).
    one_pass: bool = True
    one_pass_time_block: int = 128
    vocab_axis: str = "tp"  # mesh axis that splits lm_head's V dim

    def __post_init__(self) -> None:
        if not isinstance(self.one_pass, bool):
            raise ValueError(f"fused loss option one_pass must be true or false, got {self.one_pass!r}")
        for name in ("block_size", "time_block", "one_pass_time_block"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"fused loss option {name} must be a positive int, got {value!r}")


@dataclass(frozen=True)
class FusedKernels:
    """Pure-JAX `OnePassKernels` (see `grpo_losses.vocab_parallel`)."""

    block_size: int
    time_block: int
    one_pass_time_block: int = 128

    def one_pass(self, h: Array, w: Array, targets: Array, inv_temp: Array, terms, token_grads,
                 with_entropy: bool, vocab_axis: str | None):
        """Per token block: full logits (1st matmul), exact softmax stats, the loss's
        per-token cotangents, then d h (2nd) and d w (3rd) from the same logits."""
        rows = min(self.one_pass_time_block, h.shape[0])

        def token_block(carry, start, skip):
            logp, ent, dh, dw = carry
            block = jax.tree.map(lambda x: _rows(x, start, rows), terms)
            h_block, hits = _rows(h, start, rows), target_hits(_rows(targets, start, rows), 0, w.shape[1])
            z = _logits(h_block, w, inv_temp)  # [rows, Vl]
            stats = finish_stats(online_update(VocabStats.empty(rows, with_entropy), z, hits), vocab_axis)
            g_lp, g_ent = token_grads(stats.logp, stats.entropy, block)
            dz = logits_grad(z, hits, stats.lse, g_lp, stats.mean_logit, g_ent, inv_temp).astype(w.dtype)
            h_new = jnp.where(fresh(skip, (rows, 1), 0), h_block, 0)  # rows seen before add nothing to d w
            dw = self._add_weight_grad(dw, h_new, dz)
            dh_block = lax.dot_general(dz, w, (((1,), (1,)), ((), ())), preferred_element_type=F32)
            updates = (stats.logp, stats.entropy, dh_block)
            return (*(None if a is None else lax.dynamic_update_slice_in_dim(a, b, start, 0)
                      for a, b in zip((logp, ent, dh), updates)), dw)

        column = jnp.zeros((h.shape[0], 1), F32)
        init = (column, column if with_entropy else None, jnp.zeros(h.shape, F32), jnp.zeros(w.shape, F32))
        return fold_blocks(token_block, init, h.shape[0], self.one_pass_time_block)

    def _add_weight_grad(self, dw: Array, h: Array, dz: Array) -> Array:
        """dw += h^T dz, one vocab block at a time: a single [H, V] product would be a
        second weight-sized buffer (XLA does not accumulate a dot into its addend)."""
        width = min(self.block_size, dz.shape[1])

        def vocab_block(dw, start, skip):
            dz_block = jnp.where(fresh(skip, (1, width), 1), _columns(dz, start, width), 0)  # columns seen before add nothing
            return _add_columns(dw, lax.dot_general(h, dz_block, (((0,), (0,)), ((), ())),
                                                    preferred_element_type=F32), start)

        return fold_blocks(vocab_block, dw, dz.shape[1], self.block_size)

    def stats(self, h: Array, w: Array, targets: Array, inv_temp: Array, with_entropy: bool) -> VocabStats:
        rows = min(self.time_block, h.shape[0])

        def token_block(acc: VocabStats, start, skip) -> VocabStats:
            del skip  # rows seen before are recomputed to the same values and rewritten
            block = self._token_block_stats(_rows(h, start, rows), w, _rows(targets, start, rows),
                                            inv_temp, with_entropy)
            return VocabStats(*(None if a is None else lax.dynamic_update_slice_in_dim(a, b, start, 0)
                                for a, b in zip(acc, block)))

        return fold_blocks(token_block, VocabStats.empty(h.shape[0], with_entropy), h.shape[0], self.time_block)

    def _token_block_stats(self, h: Array, w: Array, targets: Array, inv_temp: Array,
                           with_entropy: bool) -> VocabStats:
        width = min(self.block_size, w.shape[1])

        def vocab_block(acc: VocabStats, start, skip) -> VocabStats:
            new = fresh(skip, (1, width), 1)  # columns not folded in yet
            z = jnp.where(new, _logits(h, _columns(w, start, width), inv_temp), -jnp.inf)  # [rows, width]
            return online_update(acc, z, target_hits(targets, start, width) & new)

        return fold_blocks(vocab_block, VocabStats.empty(h.shape[0], with_entropy), w.shape[1], self.block_size)

    def grads(self, h: Array, w: Array, targets: Array, inv_temp: Array, stats: TokenStats,
              g_lp: Array, g_ent: Array | None) -> tuple[Array, Array]:
        rows = min(self.time_block, h.shape[0])
        per_token = (targets, stats.lse, g_lp, stats.mean_logit, g_ent)

        def token_block(carry, start, skip):
            dh, dw = carry
            block = tuple(None if x is None else _rows(x, start, rows) for x in per_token)
            h_block = _rows(h, start, rows)
            h_new = jnp.where(fresh(skip, (rows, 1), 0), h_block, 0)  # rows seen before add nothing to d w
            dh_block, dw = self._token_block_grads(h_block, h_new, w, inv_temp, block, dw)
            return lax.dynamic_update_slice_in_dim(dh, dh_block, start, 0), dw

        init = (jnp.zeros(h.shape, F32), jnp.zeros(w.shape, F32))
        return fold_blocks(token_block, init, h.shape[0], self.time_block)

    def _token_block_grads(self, h: Array, h_new: Array, w: Array, inv_temp: Array, per_token, dw: Array):
        targets, lse, g_lp, mean_logit, g_ent = per_token
        width = min(self.block_size, w.shape[1])

        def vocab_block(carry, start, skip):
            dh, dw = carry
            w_block = _columns(w, start, width)  # [H, width]
            z = _logits(h, w_block, inv_temp)  # [rows, width]
            dz = logits_grad(z, target_hits(targets, start, width), lse, g_lp, mean_logit, g_ent, inv_temp)
            dz = jnp.where(fresh(skip, (1, width), 1), dz, 0.0).astype(w.dtype)  # matmuls in the param dtype
            dh = dh + lax.dot_general(dz, w_block, (((1,), (1,)), ((), ())), preferred_element_type=F32)
            dw_block = lax.dot_general(h_new, dz, (((0,), (0,)), ((), ())), preferred_element_type=F32)
            return dh, _add_columns(dw, dw_block, start)

        init = (jnp.zeros(h.shape, F32), dw)
        return fold_blocks(vocab_block, init, w.shape[1], self.block_size)


def _logits(h: Array, w_block: Array, inv_temp: Array) -> Array:
    return jnp.dot(h, w_block, preferred_element_type=F32) * inv_temp


def _rows(x: Array, start, rows: int) -> Array:
    return lax.dynamic_slice_in_dim(x, start, rows, axis=0)


def _columns(w: Array, start, width: int) -> Array:
    return lax.dynamic_slice_in_dim(w, start, width, axis=1)


def _add_columns(dw: Array, update: Array, start) -> Array:
    """dw[:, start:start + width] += update, in place inside loops."""
    current = lax.dynamic_slice_in_dim(dw, start, update.shape[1], axis=1)
    return lax.dynamic_update_slice_in_dim(dw, current + update, start, axis=1)


@dataclass(frozen=True)
class FusedLogps:
    """The `fused` TokenLogpsImpl. On a multi-device mesh it runs per device inside shard_map,
    on the mesh bound with `on_mesh` (the run binds its own), else the call's `mesh`, else the
    context mesh. Left to the compiler's partitioner instead, the blockwise loop over a
    batch-sharded hidden and an FSDP-sharded head contracts the sharded hidden dim and
    all-reduces float32 logits blocks: 80 GB per update on the 3B v6e-8 preset."""

    options: FusedOptions = FusedOptions()
    mesh: Any = None

    def on_mesh(self, mesh: Any) -> "FusedLogps":
        return dataclasses.replace(self, mesh=mesh)

    def __call__(self, hidden: Array, lm_head: Array, targets: Array, temperature: float | Array = 1.0,
                 *, entropy: bool = False, mesh=None) -> TokenLogps:
        return blockwise_token_logps(self._kernels(), hidden, lm_head, targets, temperature, entropy=entropy,
                                     vocab_axis=self.options.vocab_axis, mesh=self._mesh(mesh))

    @property
    def one_pass(self) -> bool:
        """Whether `grpo_loss` hands this impl the whole per-token loss (`loss_numerator`)."""
        return self.options.one_pass

    def loss_numerator(self, hidden: Array, lm_head: Array, targets: Array, temperature: float | Array,
                       terms, token_loss, *, entropy: bool, entropy_grad: bool, mesh=None):
        """(numerator, TokenLogps without gradient); see `blockwise_loss_numerator`."""
        return blockwise_loss_numerator(self._kernels(), hidden, lm_head, targets, temperature, terms, token_loss,
                                        entropy=entropy, entropy_grad=entropy_grad,
                                        vocab_axis=self.options.vocab_axis, mesh=self._mesh(mesh))

    def _mesh(self, mesh: Any) -> Any:
        return self.mesh if mesh is None else mesh

    def _kernels(self) -> FusedKernels:
        return FusedKernels(self.options.block_size, self.options.time_block, self.options.one_pass_time_block)


def build_fused(options: FusedOptions) -> FusedLogps:
    """`LossSpec.factory` of the `fused` implementation."""
    return FusedLogps(options)
