"""One-token decode step with attention specialised for a single query per row.

Reuses the model's modules, weights and KV-cache layout (grpo_core.models: k/v
[L, B, S, KV, D], mask [B, S], shared write index) and replaces only the attention
product: the query of each row is one [N, D] matrix, grouped as [KV, G, D] so every
KV head serves its G query heads without repeating K/V, and the softmax runs over the
cache axis in the cache's own [B, S, KV, ...] order (no [B, KV, G, T, S] score tensor).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from grpo_core.models.attention_impls import within_window
from grpo_rollout.head_parallel import HeadParallel
from grpo_rollout.model_parallel import ActivationLayout

# Finite "minus infinity", as in the model: a row with no visible slot stays NaN-free.
_MASKED = float(jnp.finfo(jnp.float32).min)


def decode_attention(q: jax.Array, k: jax.Array, v: jax.Array, visible: jax.Array) -> jax.Array:
    """softmax(q k^T / sqrt(D)) v for one query token: q [B, N, D], k/v [B, S, KV, D],
    visible [B, S] -> [B, N, D]. Query head n uses KV head n // G (HF repeat_kv order)."""
    batch, heads, dim = q.shape
    kv_heads = k.shape[2]
    q = q.reshape(batch, kv_heads, heads // kv_heads, dim)
    scores = jnp.einsum("bkgd,bskd->bskg", q, k, preferred_element_type=jnp.float32) * dim**-0.5
    scores = jnp.where(visible[:, :, None, None], scores, _MASKED)  # [B, S, KV, G]
    probs = jax.nn.softmax(scores, axis=1).astype(v.dtype)
    return jnp.einsum("bskg,bskd->bkgd", probs, v).reshape(batch, heads, dim)


def decode_inputs(model, tokens: jax.Array, positions: jax.Array, layout: ActivationLayout):
    """(x [B, 1, H], cos, sin) of one decode step: the embedded tokens (times the family's scale)
    and the rope tables at `positions` [B, 1] (`QwenModel.rope`: stacked global and sliding ones
    with sliding-window layers). q and k are made from the replicated residual, so the tables are
    made replicated once per token (split by rows, XLA gathered them again in every layer)."""
    cos, sin = model.rope(layout.replicated(positions))
    return model.scale_embeddings(layout.embed(model.embed_tokens.embedding[...], tokens[:, None])), cos, sin


def windowed(visible: jax.Array, query_slot: jax.Array, window: jax.Array | None) -> jax.Array:
    """visible [B, S] (key slots 0..S-1) narrowed to the slots a query at `query_slot` sees through
    a sliding window (query slot - key slot < window; HF's sliding mask); window None: as it is."""
    if window is None:
        return visible
    return visible & within_window(jnp.arange(visible.shape[1]), query_slot, window)[None]


def decode_layers(model, x: jax.Array, cache, cos: jax.Array, sin: jax.Array, layout, attention):
    """Run one token per row through every layer; only the attention differs between caches.
    Returns (x, cache, the experts [B, L, k] each layer sent each row's token to: None for a dense model).

    attention(cache) -> attend, built from the cache the layers see (a device's share of it in
    the head-parallel decode), where attend(i, cache, q [B, N, D], k [B, 1, KV, D], v [B, 1, KV, D],
    window) -> (attended [B, N, D], cache) writes layer i's new keys and values and attends over the
    rows' cache (within layer i's sliding window: `QwenModel.layer_tables`). A family's post-norms
    and embedding scale are applied as the model's own layer does (`DecoderLayer.add_attention`).

    Model-parallel (`layout` with a mesh), each layer runs 4 collectives per token: q to the
    rows' devices and the attention back (2 all-to-all), and one all-reduce each of o_proj's
    and down_proj's partial sums into the replicated residual. Two pins keep it so:
    - k and v (their projections are never split: model_parallel.SPLIT_DIMENSIONS) stay
      replicated until the cache write slices them: pinned to the rows, they were made from a
      row slice of the normed residual, and the compiler then normed a row slice and gathered
      it for q (an all-gather, or a ring of collective-permutes);
    - the residual leaving the layers is replicated: unpinned, the rows split of the sampled
      logits reached back into the layer loop's carry, and each all-reduce then updated a row
      slice that the next layer norm all-gathered again.
    """
    attend = attention(cache)

    def step(layer, i, carry):
        (x, cache, routing), (cos_i, sin_i, window) = carry, model.layer_tables(i, cos, sin)
        q, k, v = layer.self_attn.project_qkv(layer.input_layernorm(x), layout.replicated(cos_i), layout.replicated(sin_i))
        q, k, v = layout.rows(layout.split(q, 2)), layout.replicated(k), layout.replicated(v)
        attended, cache = attend(i, cache, q[:, 0], k, v, window)  # computed where the rows' cache is
        attended = layout.split(layout.rows(attended)[:, None], 2)
        x = layer.add_attention(x, layout.replicated(layer.self_attn.o_proj(attended)))
        x, experts = layer.add_routed_mlp(x, layout.replicated)
        return x, cache, None if routing is None else routing.at[:, i].set(experts)

    x, cache, routing = model.over_layers(step, (x, cache, empty_routing(model.config, x.shape[0])))
    return layout.replicated(x), cache, routing


def empty_routing(config, rows: int) -> jax.Array | None:
    """[rows, L, k] int32 of -1 for a mixture-of-experts model's routing record, None for a dense one."""
    if not config.family.sparse_mlp:
        return None
    return jnp.full((rows, config.num_hidden_layers, config.num_experts_per_tok), -1, jnp.int32)


def plain_attention(cache, view: int | None = None):
    """The attend function of decode_layers over a plain KVCache (prompt and completion slots).
    view: attend over cache slots [:view] only (they hold every visible slot: the rest are empty);
    None, all. A sliding window counts real slots, not slots: the rows of a kept cache
    (grpo_rollout.kept_cache) may hold empty slots between their tokens."""
    visible = cache.visibility(1)[:, 0, :view]  # [B, view]
    # Per slot: the query's position minus its token's (positions count real slots, as the model's do).
    behind = cache.lengths()[:, None] - jnp.cumsum(cache.mask, axis=1, dtype=jnp.int32)[:, :view]

    def attend(i, cache, q, k, v, window=None):
        cache = cache.write_layer(i, k, v)
        keys, values = cache.k[i, :, :view], cache.v[i, :, :view]  # a static slice: only it is read
        seen = visible if window is None else visible & (behind < window)
        return decode_attention(q, keys.astype(q.dtype), values.astype(q.dtype), seen), cache

    return attend


def decode_forward(model, tokens: jax.Array, live: jax.Array, cache, layout: ActivationLayout | HeadParallel = ActivationLayout(),
                   attention=plain_attention, view: int | None = None):
    """`routed_decode_forward` without the routing: (hidden [B, 1, H], cache)."""
    return routed_decode_forward(model, tokens, live, cache, layout, attention, view)[:2]


def routed_decode_forward(model, tokens: jax.Array, live: jax.Array, cache,
                          layout: ActivationLayout | HeadParallel = ActivationLayout(), attention=plain_attention,
                          view: int | None = None):
    """Feed one token per row: tokens [B], live [B] bool (False: the slot stays invisible).

    Same math and op order as `model(tokens[:, None], attention_mask=live[:, None],
    cache=cache)` except for the attention product, which `attention(cache)` builds
    (`plain_attention` for a KVCache, `cascade.cascade_over` for a SharedCache). `layout` pins the
    activations of a model-parallel decode (grpo_rollout.model_parallel), or runs the step
    head-parallel (grpo_rollout.head_parallel). view: the attention reads the cache's (or a shared
    cache's completion part's) slots [:view] only (grpo_rollout.segments). A family's sliding
    windows, post-norms and embedding scale are honoured in every layout. Returns (hidden [B, 1, H],
    cache, routing): a mixture-of-experts model's experts [B, L, k] for each row's token
    (`decode_layers`; None for a dense model, and head-parallel).
    """
    attention = functools.partial(attention, view=view)
    if isinstance(layout, HeadParallel):
        (x, cache), routing = layout.forward(model, tokens, live, cache, attention), None
    else:
        x, cos, sin = decode_inputs(model, tokens, cache.lengths()[:, None], layout)  # lengths: this token's position
        cache = cache.with_new_tokens(live[:, None])
        x, cache, routing = decode_layers(model, x, cache, cos, sin, layout, attention)
    return model.norm(x), cache.advance(1), routing
