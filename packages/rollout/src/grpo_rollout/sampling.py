"""Next-token sampling: greedy, temperature, top-k, top-p, with per-token log-probs.

Sampling is exact inverse-CDF sampling with ONE uniform number per row. Drawing a
categorical the usual way (Gumbel noise per vocabulary entry) costs several times the
LM-head matmul on CPU; here the cost is two streaming passes over the logits (a max
and an exp-sum per block of the vocabulary) plus work on one block per row.

Filtered-out tokens (top-k, top-p) are never sampled. The returned log-prob is, by
default, log_softmax(logits / T) of the UNFILTERED distribution — the quantity the
training loss recomputes — or, with `filtered_logps=True`, the log-prob under the
renormalised filtered distribution that was actually sampled from.

Top-p keeps token i when the mass of tokens strictly more probable than i is below
top_p (ties at the boundary are all kept; Hugging Face's sort-based warper keeps an
arbitrary subset of such exact ties, otherwise the two agree). No full-vocabulary sort
(about 2 s for [64, 151936] on a 2-core CPU): the nucleus is first searched among the
`top_p_candidates` most probable tokens (lax.top_k), and only when a row's nucleus is
larger does the step run an exact bisection for the probability threshold.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from grpo_core.contracts import SamplingParams

# Top-p first looks for the nucleus among this many most probable tokens; only when a
# row's nucleus is larger does the step fall back to an exact threshold search.
DEFAULT_TOP_P_CANDIDATES = 256


# ---- vocabulary blocks ----------------------------------------------------------------
def cdf_block_size(vocab: int) -> int:
    """Block width of the two-level search: a divisor of vocab near sqrt(vocab) when one
    exists (no padding copy), else a power of two (the logits get padded)."""
    root = math.isqrt(vocab)
    for width in sorted(range(max(1, root // 4), 4 * root + 2), key=lambda d: abs(d - root)):
        if vocab % width == 0:
            return width
    return 1 << max(0, root.bit_length())


def to_blocks(scaled: jax.Array, block: int) -> jax.Array:
    """[B, V] -> [B, V/block, block], padding the tail with -inf (probability 0)."""
    batch, vocab = scaled.shape
    pad = (-vocab) % block
    if pad:
        scaled = jnp.pad(scaled, ((0, 0), (0, pad)), constant_values=-jnp.inf)
    return scaled.reshape(batch, -1, block)


def _take_block(blocks: jax.Array, index: jax.Array) -> jax.Array:
    """blocks [B, NB, W], index [B] -> [B, W]."""
    return jnp.take_along_axis(blocks, index[:, None, None], axis=1)[:, 0]


def _take(values: jax.Array, index: jax.Array) -> jax.Array:
    """values [B, N], index [B] -> [B]."""
    return jnp.take_along_axis(values, index[:, None], axis=1)[:, 0]


def _first_argmax(values: jax.Array) -> jax.Array:
    """argmax over the last axis [B, N] -> [B]; first index on ties (like torch/numpy)."""
    top = jnp.max(values, axis=-1, keepdims=True)
    iota = jax.lax.broadcasted_iota(jnp.int32, values.shape, values.ndim - 1)
    return jnp.min(jnp.where(values == top, iota, values.shape[-1]), axis=-1)


# ---- inverse CDF ----------------------------------------------------------------------
def search_cumulative(weights: jax.Array, cum: jax.Array, threshold: jax.Array) -> jax.Array:
    """First index with cum > threshold [B], where cum [B, N] is the inclusive cumsum of
    weights [B, N] >= 0. Never returns a zero-weight index: float rounding that pushes
    the count past the end lands on the last positive entry instead."""
    index = jnp.sum(cum <= threshold[:, None], axis=-1, dtype=jnp.int32)
    iota = jax.lax.broadcasted_iota(jnp.int32, weights.shape, 1)
    last_positive = jnp.max(jnp.where(weights > 0, iota, 0), axis=-1)
    return jnp.minimum(index, last_positive)


def inverse_cdf(weights: jax.Array, uniforms: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Sample index [B] with probability weights / sum(weights); also returns the sum [B]."""
    cum = jnp.cumsum(weights, axis=-1)  # [B, N]
    total = cum[:, -1]
    return search_cumulative(weights, cum, uniforms * total), total


def sample_blocks(blocks: jax.Array, row_max: jax.Array, uniforms: jax.Array):
    """Exact sample from softmax over blocks [B, NB, W] with one uniform per row.

    Returns (token index into the flattened vocab [B], log of the total mass [B]
    relative to row_max, i.e. logsumexp = row_max + log_mass).
    """
    # The total is read off the block cumsum, not summed from the exponentials again:
    # a second reduction of exp(blocks) would force XLA to materialise it ([B, V] f32).
    block_mass = jnp.sum(jnp.exp(blocks - row_max[:, None, None]), axis=-1)  # [B, NB]
    cum = jnp.cumsum(block_mass, axis=-1)
    total = cum[:, -1]
    threshold = uniforms * total
    block = search_cumulative(block_mass, cum, threshold)  # [B]
    before = _take(cum, block) - _take(block_mass, block)
    inner = jnp.exp(_take_block(blocks, block) - row_max[:, None])  # [B, W]
    inner_cum = jnp.cumsum(inner, axis=-1)
    within = search_cumulative(inner, inner_cum, threshold - before)
    return block * blocks.shape[2] + within, jnp.log(total)


# ---- top-p ----------------------------------------------------------------------------
def nucleus_keep_sorted(sorted_weights: jax.Array, budget: jax.Array) -> jax.Array:
    """Keep mask [B, N] for weights sorted descending: mass strictly above < budget [B]."""
    exclusive = jnp.cumsum(sorted_weights, axis=-1) - sorted_weights  # [B, N]
    iota = jax.lax.broadcasted_iota(jnp.int32, sorted_weights.shape, 1)
    starts = jnp.concatenate(
        [jnp.ones_like(sorted_weights[:, :1], bool), sorted_weights[:, 1:] != sorted_weights[:, :-1]], axis=1)
    group_start = jax.lax.cummax(jnp.where(starts, iota, 0), axis=1)  # first index of each tie group
    strictly_above = jnp.take_along_axis(exclusive, group_start, axis=1)
    return strictly_above < budget[:, None]


def nucleus_threshold(weights: jax.Array, budget: jax.Array, iterations: int = 31) -> jax.Array:
    """Smallest v [B] with sum(weights > v) < budget, for weights [B, ...] in [0, 1].

    Token i is in the nucleus iff weights_i >= v. Bisection over the bit patterns of
    non-negative f32 (ordered like the integers), so the result is exact.
    """
    axes = tuple(range(1, weights.ndim))
    bits = lambda x: jax.lax.bitcast_convert_type(x, jnp.int32)

    def mass_above(v_bits):
        v = jax.lax.bitcast_convert_type(v_bits, jnp.float32).reshape((-1,) + (1,) * len(axes))
        return jnp.sum(jnp.where(weights > v, weights, 0.0), axis=axes)

    def step(_, bounds):
        low, high = bounds  # invariant: mass_above(low) >= budget > mass_above(high)
        mid = low + (high - low) // 2
        inside = mass_above(mid) < budget
        return jnp.where(inside, low, mid), jnp.where(inside, mid, high)

    batch = weights.shape[0]
    low = jnp.full((batch,), -1, jnp.int32)  # "below 0": every positive weight is above it
    high = jnp.full((batch,), bits(jnp.float32(1.0)), jnp.int32)
    _, high = jax.lax.fori_loop(0, iterations, step, (low, high))
    return jax.lax.bitcast_convert_type(high, jnp.float32)


# ---- samplers -------------------------------------------------------------------------
def sample_next(logits: jax.Array, uniforms: jax.Array, params: SamplingParams, *,
                block: int | None = None, top_p_candidates: int = DEFAULT_TOP_P_CANDIDATES):
    """Sample one token per row from logits [B, V] with uniforms [B] in [0, 1).

    Returns (tokens [B] int32, logps [B] f32); see the module docstring for which
    distribution the logps are of. `block` is the vocabulary block width of the
    two-level search (default `cdf_block_size(V)`).
    """
    scaled = logits.astype(jnp.float32) / jnp.float32(params.temperature)  # [B, V]
    block = block or cdf_block_size(scaled.shape[1])
    if params.mode == "greedy":
        return _greedy(scaled, block)
    if params.mode == "top_k":
        return _sample_top_k(scaled, uniforms, params)
    if params.mode == "top_p":
        return _sample_top_p(scaled, uniforms, params, block, top_p_candidates)
    return _sample_full(scaled, uniforms, block)


def _row_max_and_log_mass(blocks: jax.Array):
    """blocks [B, NB, W] -> (max [B], log sum exp(blocks - max) [B])."""
    row_max = jnp.max(blocks, axis=(1, 2))
    mass = jnp.sum(jnp.exp(blocks - row_max[:, None, None]), axis=(1, 2))
    return row_max, jnp.log(mass)


def _sample_full(scaled, uniforms, block):
    blocks = to_blocks(scaled, block)  # [B, NB, W]
    row_max = jnp.max(blocks, axis=(1, 2))
    tokens, log_mass = sample_blocks(blocks, row_max, uniforms)
    return tokens, _take(scaled, tokens) - row_max - log_mass


def _greedy(scaled, block):
    blocks = to_blocks(scaled, block)  # [B, NB, W]
    block_max = jnp.max(blocks, axis=-1)  # [B, NB]
    best_block = _first_argmax(block_max)  # the first block holding the max
    tokens = best_block * block + _first_argmax(_take_block(blocks, best_block))
    row_max = _take(block_max, best_block)
    log_mass = jnp.log(jnp.sum(jnp.exp(blocks - row_max[:, None, None]), axis=(1, 2)))
    return tokens, _take(scaled, tokens) - row_max - log_mass


def _sample_top_k(scaled, uniforms, params):
    values, indices = jax.lax.top_k(scaled, min(params.top_k, scaled.shape[1]))  # [B, k] descending
    weights = jnp.exp(values - values[:, :1])
    if params.top_p < 1.0:
        keep = nucleus_keep_sorted(weights, params.top_p * jnp.sum(weights, axis=-1))
        weights = jnp.where(keep, weights, 0.0)
    choice, kept_mass = inverse_cdf(weights, uniforms)
    tokens = _take(indices, choice)
    if params.filtered_logps:
        return tokens, _take(values, choice) - values[:, 0] - jnp.log(kept_mass)
    log_mass = jnp.log(jnp.sum(jnp.exp(scaled - values[:, :1]), axis=-1))
    return tokens, _take(values, choice) - values[:, 0] - log_mass


def _sample_top_p(scaled, uniforms, params, block, num_candidates):
    blocks = to_blocks(scaled, block)  # [B, NB, W]
    row_max, log_mass = _row_max_and_log_mass(blocks)
    budget = params.top_p * jnp.exp(log_mass)  # nucleus mass, relative to exp(row_max)
    num_candidates = min(num_candidates, scaled.shape[1])
    values, indices = jax.lax.top_k(scaled, num_candidates)  # [B, C] descending
    weights = jnp.exp(values - row_max[:, None])
    keep = nucleus_keep_sorted(weights, budget)

    def among_candidates():
        choice, kept_mass = inverse_cdf(jnp.where(keep, weights, 0.0), uniforms)
        return _take(indices, choice), jnp.log(kept_mass)

    def over_vocab():
        probs = jnp.exp(blocks - row_max[:, None, None])  # [B, NB, W]
        threshold = nucleus_threshold(probs, budget)
        kept = jnp.where(probs >= threshold[:, None, None], blocks, -jnp.inf)
        return sample_blocks(kept, row_max, uniforms)

    if num_candidates == scaled.shape[1]:
        tokens, log_kept = among_candidates()
    else:  # the nucleus lies among the candidates unless the last candidate is still in it
        tokens, log_kept = jax.lax.cond(jnp.any(keep[:, -1]), over_vocab, among_candidates)
    log_norm = log_kept if params.filtered_logps else log_mass
    return tokens, _take(scaled, tokens) - row_max - log_norm
