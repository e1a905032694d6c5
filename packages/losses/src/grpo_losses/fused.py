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
"""

from __future__ import annotations

from dataclasses import dataclass

import jax.numpy as jnp
from jax import lax

from grpo_losses.blockmath import (
    F32,
    TokenStats,
    VocabStats,
    fold_blocks,
    fresh,
    logits_grad,
    online_update,
    target_hits,
)
from grpo_losses.logps import Array, TokenLogps
from grpo_losses.vocab_parallel import blockwise_token_logps


@dataclass(frozen=True)
class FusedOptions:
    """`loss.options` of the `fused` implementation."""

    # 1024 tokens x 2048 columns (an 8 MiB float32 logits block): CPU time at
    # B=2, T=512, V=151936, H=512 was flat (within 10%) from 1024 to 8192 columns and
    # 256 to 1024 tokens; this end keeps the B=8, T=2048, H=2048 temp far below 256 MiB.
    block_size: int = 2048
    time_block: int = 1024
    vocab_axis: str = "tp"  # mesh axis that splits lm_head's V dim

    def __post_init__(self) -> None:
        for name in ("block_size", "time_block"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"fused loss option {name} must be a positive int, got {value!r}")


@dataclass(frozen=True)
class FusedKernels:
    """Pure-JAX `VocabKernels` (see `grpo_losses.vocab_parallel`)."""

    block_size: int
    time_block: int

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
    """The `fused` TokenLogpsImpl; `mesh` overrides the context mesh (tests, scripts)."""

    options: FusedOptions = FusedOptions()

    def __call__(self, hidden: Array, lm_head: Array, targets: Array, temperature: float | Array = 1.0,
                 *, entropy: bool = False, mesh=None) -> TokenLogps:
        kernels = FusedKernels(self.options.block_size, self.options.time_block)
        return blockwise_token_logps(kernels, hidden, lm_head, targets, temperature, entropy=entropy,
                                     vocab_axis=self.options.vocab_axis, mesh=mesh)


def build_fused(options: FusedOptions) -> FusedLogps:
    """`LossSpec.factory` of the `fused` implementation."""
    return FusedLogps(options)
