"""Softmax statistics over vocab blocks: the math shared by the `fused` and `pallas`
implementations (and by every vocab shard when the LM head is sharded over `tp`).

With z = (h . w) / temperature for one token and a vocab split into blocks, the
forward keeps per token an online log-sum-exp state:
    m  = running max of z            s  = sum exp(z - m)
    zt = z at the target column      a  = sum exp(z - m) * z   (only for entropy)
so  lse = m + log s,  logp = zt - lse,  E_p[z] = a / s,  entropy = lse - E_p[z].
Partial states of disjoint vocab ranges (blocks, or shards on other devices)
combine by rescaling to a common max. Per-token values are column vectors
[N, 1] so the same code runs inside Pallas kernels (2-D tiles) and plain JAX.

The backward recomputes each logits block and forms, for cotangents g_lp
(of logp) and g_ent (of entropy),
    dL/dz_v = g_lp * [v == target] - p_v * (g_lp + g_ent * (z_v - E_p[z]))
because d lse/dz_v = p_v and d entropy/dz_v = -p_v * (z_v - E_p[z]).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple, TypeVar

import jax
import jax.numpy as jnp
from jax import lax

Array = jax.Array
Carry = TypeVar("Carry")
F32 = jnp.float32


class VocabStats(NamedTuple):
    """Online log-sum-exp state per token, float32 [N, 1] each (see module doc)."""

    m: Array
    s: Array
    zt: Array
    a: Array | None = None

    @classmethod
    def empty(cls, rows: int, with_entropy: bool) -> VocabStats:
        zeros = jnp.zeros((rows, 1), F32)
        return cls(jnp.full((rows, 1), -jnp.inf, F32), zeros, zeros, zeros if with_entropy else None)


class TokenStats(NamedTuple):
    """Final per-token results, float32 [N, 1] each; `entropy`/`mean_logit` None
    when entropy was not asked for. `lse` and `mean_logit` feed the backward."""

    logp: Array
    entropy: Array | None
    lse: Array
    mean_logit: Array | None


def fold_blocks(step: Callable[[Carry, Array, Array], Carry], carry: Carry, size: int, block: int) -> Carry:
    """carry = step(carry, start, skip) over blocks of width min(block, size) covering [0, size).

    One loop body for every block, nothing padded or copied: when `block` does
    not divide `size`, the last block is shifted back to end at `size` and
    overlaps its predecessor; `skip` (0 for all other blocks) is how many of its
    leading entries were already covered, and the step must ignore them.
    """
    width = min(block, size)
    count = -(-size // width)

    def body(i, carry):
        start = jnp.minimum(i * width, size - width)
        return step(carry, start, i * width - start)

    return lax.fori_loop(0, count, body, carry)


def fresh(skip: Array, shape: tuple[int, int], axis: int) -> Array:
    """bool of `shape`: index along `axis` >= skip (the part of a block not seen before)."""
    return lax.broadcasted_iota(jnp.int32, shape, axis) >= skip


def target_hits(targets: Array, start: Array | int, width: int) -> Array:
    """[N, width] bool: column start + j is the token's target (targets [N, 1], local ids)."""
    return column_ids(start, width) == targets


def column_ids(start: Array | int, width: int) -> Array:
    """[1, width] int32 ids of the columns start .. start + width - 1."""
    return start + lax.broadcasted_iota(jnp.int32, (1, width), 1)


def online_update(acc: VocabStats, z: Array, hits: Array) -> VocabStats:
    """Fold one logits block z [N, W] (float32, invalid columns = -inf) into acc."""
    m = jnp.maximum(acc.m, jnp.max(z, axis=1, keepdims=True))
    rescale = jnp.exp(acc.m - m)  # exp(-inf) = 0 on the first block
    e = jnp.exp(z - m)  # [N, W]
    s = acc.s * rescale + jnp.sum(e, axis=1, keepdims=True)
    zt = acc.zt + jnp.sum(jnp.where(hits, z, 0.0), axis=1, keepdims=True)
    a = None
    if acc.a is not None:  # e == 0 where z == -inf: keep 0 * -inf out of the sum
        a = acc.a * rescale + jnp.sum(jnp.where(e > 0, e * z, 0.0), axis=1, keepdims=True)
    return VocabStats(m, s, zt, a)


def finish_stats(local: VocabStats, vocab_axis: str | None) -> TokenStats:
    """Combine the per-shard states over `vocab_axis` (inside shard_map; None when
    the vocab is not split) and derive logp, entropy and the backward residuals."""
    m = local.m if vocab_axis is None else lax.pmax(local.m, vocab_axis)
    rescale = jnp.exp(local.m - m)
    s, zt = _vocab_sum(local.s * rescale, vocab_axis), _vocab_sum(local.zt, vocab_axis)
    lse = m + jnp.log(s)
    if local.a is None:
        return TokenStats(zt - lse, None, lse, None)
    mean_logit = _vocab_sum(local.a * rescale, vocab_axis) / s
    return TokenStats(zt - lse, lse - mean_logit, lse, mean_logit)


def _vocab_sum(x: Array, vocab_axis: str | None) -> Array:
    return x if vocab_axis is None else lax.psum(x, vocab_axis)


def logits_grad(z: Array, hits: Array, lse: Array, g_lp: Array, mean_logit: Array | None,
                g_ent: Array | None, inv_temp: Array) -> Array:
    """dL/d(h . w) for one block: z [N, W] scaled logits, per-token columns [N, 1].

    Returns float32 [N, W]; the trailing `inv_temp` is the chain rule through
    z = (h . w) * inv_temp.
    """
    p = jnp.exp(z - lse)
    weight = g_lp if g_ent is None else g_lp + g_ent * (z - mean_logit)
    return (jnp.where(hits, g_lp, 0.0) - p * weight) * inv_temp
