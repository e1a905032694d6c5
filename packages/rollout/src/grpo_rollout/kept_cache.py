"""Partial-rollout rounds on a KV cache kept across rounds (rollout.partial.kv_cache).

A slot's row either continues from its kept cache (only its last sampled token, not yet
fed, goes in) or is admitted: a new, restarted or resumed row, whose prompt plus tokens so
far, all but the last, are run into the slot. The cache keeps the decode's layout (one
write index for all rows, positions counted from the mask), so a round is:

    compact:  every kept row's visible slots move, in order, to end at slot `base`
              (a per-row gather); admitted rows are emptied
    admit:    the admitted rows' prefixes go to slots [base, base + A) in one masked forward
              (kept rows feed masked pads there: invisible), left-padded; the tokens appended to a
              kept row (a multi-turn row's tool turn) go there right-padded, right after its kept
              tokens: positions count the visible slots, so they continue the row's sequence, and
              the model's forward, which counts a sliding window in slots, sees no gap in it
    decode:   the usual loop writes [base + A, base + A + budget), starting from each
              row's last token

The kept keys and values were computed under the weights of the rounds that wrote them;
the tokens sampled from them keep the log-probs they were drawn with, which the loss's
mismatch correction uses.
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from grpo_rollout.decode import PHASE_STATIC_ARGS, LoopState, constrain, constrain_cache, rollout_weights
from grpo_rollout.prompts import bucket_length


@functools.partial(jax.jit, static_argnames=("base", "width", "batch_sharding"))
def compact(cache, keep: jax.Array, *, base: int, width: int, batch_sharding=None):
    """Each kept row's visible slots, in order, moved to end at slot `base`; rows not kept
    emptied; the cache `width` slots wide with its write index at `base`."""
    visible = cache.mask & keep[:, None]
    pad, grow = max(base - cache.max_len, 0), width - base
    visible = jnp.pad(visible, ((0, 0), (pad, 0)))
    # A stable sort puts each row's invisible slots first and its visible ones last, in order.
    order = jnp.argsort(visible.astype(jnp.int32), axis=1, stable=True)[:, visible.shape[1] - base:]

    def move(slots: jax.Array) -> jax.Array:  # [L, B, S, KV, D]
        slots = jnp.pad(slots, ((0, 0), (0, 0), (pad, 0), (0, 0), (0, 0)))
        slots = jnp.take_along_axis(slots, order[None, :, :, None, None], axis=2)
        return jnp.pad(slots, ((0, 0), (0, 0), (0, grow), (0, 0), (0, 0)))

    # tree.map: an 8-bit cache's values and scales (grpo_core.models.kv_quant) move together.
    cache = cache.replace(k=jax.tree.map(move, cache.k), v=jax.tree.map(move, cache.v),
                          mask=jnp.pad(jnp.take_along_axis(visible, order, axis=1), ((0, 0), (0, grow))),
                          index=jnp.asarray(base, jnp.int32))
    return constrain_cache(cache, batch_sharding)


@functools.partial(jax.jit, static_argnames=PHASE_STATIC_ARGS, donate_argnames=("cache",))
def admit(weights, cache, ids, mask, *, graphdef, params, pad_id, cache_dtype=None, batch_sharding=None, block=None,
          top_p_candidates=None, attention="rollout", gather_weights=False, model_parallel=False):
    """Run ids [N, A] (masked where a row is not admitted) into slots [index, index + A)."""
    del params, pad_id, cache_dtype, block, top_p_candidates, attention, model_parallel  # shared static signature
    model = nnx.merge(graphdef, rollout_weights(weights, batch_sharding, gather_weights))
    _, cache = model(ids, attention_mask=mask, cache=cache)
    return constrain_cache(cache, batch_sharding)


def round_start(last: jax.Array, budget: int, pad_id: int, batch_sharding=None, live: jax.Array | None = None
                ) -> LoopState:
    """The decode loop's state at a round's start: every live row feeds `last` [N] first; a row
    not live starts done (it feeds nothing, so its cache stays as it is)."""
    rows = last.shape[0]
    done = jnp.zeros((rows,), jnp.bool_) if live is None else ~live
    return LoopState(step=jnp.zeros((), jnp.int32), last=last, done=done,
                     lengths=jnp.zeros((rows,), jnp.int32),
                     tokens=constrain(jnp.full((rows, budget), pad_id, jnp.int32), batch_sharding),
                     logps=constrain(jnp.zeros((rows, budget), jnp.float32), batch_sharding))


def kept_counts(prefixes: Sequence[Sequence[int]], cached: Sequence[bool],
                kept_tokens: Sequence[int] | None = None) -> list[int]:
    """Tokens of each prefix in the kept cache: kept_tokens (default all but the last) where
    cached, 0 where admitted."""
    counts = [len(p) - 1 for p in prefixes] if kept_tokens is None else [int(k) for k in kept_tokens]
    for p, kept, count in zip(prefixes, cached, counts):
        if kept and not 0 <= count < len(p):
            raise ValueError(f"a cached slot holds {count} tokens of its {len(p)}-token prefix; it must hold "
                             "fewer (the last token is fed by the decode)")
    return [count if kept else 0 for kept, count in zip(cached, counts)]


def kept_width(counts: Sequence[int], buckets: Sequence[int]) -> int:
    """Slots the kept rows need (their kept tokens), rounded up to a bucket; 0 without any."""
    longest = max(counts, default=0)
    return bucket_length(longest, buckets) if longest else 0


def admission_batch(prefixes: Sequence[Sequence[int]], counts: Sequence[int], pad_id: int,
                    buckets: Sequence[int], follow: Sequence[bool] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(ids, mask) [N, A]: the tokens of each prefix after its kept ones but its last (an admitted
    row's whole prefix but the last; a kept row's appended turn), left-padded, or right-padded where
    `follow` (a kept row's turn then starts at the admission's first slot, right after its kept tokens:
    no empty slot between them, for the model's forward counts a sliding window in slots); A = 0 when
    no row has any."""
    heads = [list(p[count:-1]) for p, count in zip(prefixes, counts)]
    follow = [False] * len(heads) if follow is None else follow
    longest = max(len(h) for h in heads)
    width = bucket_length(longest, buckets) if longest else 0
    ids = np.full((len(heads), width), pad_id, np.int32)
    mask = np.zeros((len(heads), width), np.int32)
    for row, (head, right) in enumerate(zip(heads, follow)):
        if head:
            span = slice(0, len(head)) if right else slice(width - len(head), width)
            ids[row, span], mask[row, span] = head, 1
    return ids, mask
