"""Shared-prompt decode: each prompt's KV cache stored once for its group of n samples.

The n samples of a GRPO group share their prompt. Instead of n copies of the prompt's
cache, the decode keeps two caches (`SharedCache`): the prompt part [L, P, Tp, KV, D],
written once by a prefill of the P prompts, and each row's own completion part
[L, P*n, Tc, KV, D]. One decode step attends over both and merges them exactly
(cascade attention; Juravsky et al. 2024, "Hydragen: High-Throughput LLM Inference with
Shared Prefixes", arXiv:2402.05099). For a query q and key sets A (prompt) and B
(completion), with scores s_j = q.k_j / sqrt(D), per part

    m_X = max_{j in X} s_j,   l_X = sum_{j in X} exp(s_j - m_X),   o_X = sum_{j in X} exp(s_j - m_X) v_j

and with m = max(m_A, m_B):

    softmax(s) v = (exp(m_A - m) o_A + exp(m_B - m) o_B) / (exp(m_A - m) l_A + exp(m_B - m) l_B),

which is the attention over A and B together, not an approximation. The prompt part is
one product per group: the group's n query rows are extra query heads against the one
prompt cache, so each prompt key and value is read once per group and step, not n times.

Partial rollouts (`TableCache`) hold rows of different groups at different depths in their
slots: each live group's prompt sits once in a slot g of a prompt table [L, G, Tp, KV, D], each
row is mapped to (g, member j), and the prompt part runs on the queries scattered into
[G, n, ...], its (m, l, o) gathered back to the rows and merged by the same formula. There a
sliding window masks each row's prompt and own slots by token position (`TableCache.windowed`):
its prompt part is masked per row, [G, n, Tp], not per group.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from grpo_core.models.attention import KVCache
from grpo_rollout.attention import routed_decode_forward, windowed
from grpo_rollout.model_parallel import ActivationLayout

# Finite "minus infinity", as in the model: a part with no visible slot adds nothing.
_MASKED = float(jnp.finfo(jnp.float32).min)


@struct.dataclass
class SharedCache:
    """prompt: [L, P, Tp, KV, D], mask [P, Tp], written once and only read by the decode;
    completion: [L, P*n, Tc, KV, D], row r of group r // n, written one slot per step."""

    prompt: KVCache
    completion: KVCache

    @property
    def group(self) -> int:
        return self.completion.mask.shape[0] // self.prompt.mask.shape[0]

    @property
    def max_len(self) -> int:
        """Slots a row sees: its prompt and its completion."""
        return self.prompt.max_len + self.completion.max_len

    def lengths(self) -> jax.Array:
        """[P*n] real tokens cached per row = the position of each row's next token."""
        return jnp.repeat(self.prompt.lengths(), self.group) + self.completion.lengths()

    def attention(self, q, prompt_k, prompt_v, own_k, own_v, own_visible, prompt_visible=None) -> jax.Array:
        """prompt_visible [P, Tp]: the prompt slots the rows see (None: every real one)."""
        prompt_visible = self.prompt.mask if prompt_visible is None else prompt_visible
        return cascade_attention(q, prompt_k, prompt_v, prompt_visible, own_k, own_v, own_visible)

    def windowed(self, own_visible: jax.Array, window: jax.Array | None) -> tuple[jax.Array, jax.Array]:
        """(prompt [P, Tp], own [B, view]) slots the query of this step sees through a sliding window.
        A row's slots are its prompt's [0, Tp) then its own, Tp + j (prompts are left-padded to Tp and
        completions fill their slots in order, so slot distance is position distance)."""
        query = self.prompt.max_len + self.completion.index
        return windowed(self.prompt.mask, query, window), windowed(own_visible, self.completion.index, window)

    def with_new_tokens(self, token_mask: jax.Array) -> "SharedCache":
        return with_new_own_tokens(self, token_mask)

    def advance(self, num_tokens: int) -> "SharedCache":
        return self.replace(completion=self.completion.advance(num_tokens))


def with_new_own_tokens(cache, token_mask: jax.Array):
    """A SharedCache or TableCache whose new tokens [B, T] go to the rows' own part
    (KVCache.with_new_tokens): the prompt part is only read."""
    return cache.replace(completion=cache.completion.with_new_tokens(token_mask))


def _part(scores: jax.Array, visible: jax.Array):
    """(m, p) of one part: scores [X, S, ...] masked by visible [X, S] (or [X, S, n]: per query row),
    m its max over S, p the shifted exponentials (0 where not visible)."""
    visible = visible.reshape(visible.shape + (1,) * (scores.ndim - visible.ndim))
    scores = jnp.where(visible, scores, _MASKED)
    peak = jnp.max(scores, axis=1, keepdims=True)
    return peak[:, 0], jnp.where(visible, jnp.exp(scores - peak), 0.0)


def grouped_queries(q: jax.Array, kv_heads: int) -> jax.Array:
    """q [B, N, D] -> [B, KV, G, D]: query head h uses KV head h // G (HF repeat_kv order)."""
    rows, heads, dim = q.shape
    return q.reshape(rows, kv_heads, heads // kv_heads, dim)


def prompt_part(grouped: jax.Array, prompt_k: jax.Array, prompt_v: jax.Array, prompt_visible: jax.Array):
    """(m, l, o) of the prompt part, one product per group: grouped [P, n, KV, G, D] (the group's n
    rows as extra query heads), prompt_k/v [P, Sp, KV, D], prompt_visible [P, Sp] (or [P, n, Sp]: each
    row's own, through a sliding window) -> m, l [P, n, KV, G] and o [P, n, KV, G, D] (f32)."""
    scores = jnp.einsum("pnkgd,pskd->psnkg", grouped, prompt_k, preferred_element_type=jnp.float32)
    if prompt_visible.ndim == 3:
        prompt_visible = prompt_visible.swapaxes(1, 2)  # [P, Sp, n], as the scores
    peak, p = _part(scores * grouped.shape[-1] ** -0.5, prompt_visible)
    out = jnp.einsum("psnkg,pskd->pnkgd", p.astype(prompt_v.dtype), prompt_v, preferred_element_type=jnp.float32)
    return peak, jnp.sum(p, axis=1), out


def own_part(grouped: jax.Array, own_k: jax.Array, own_v: jax.Array, own_visible: jax.Array):
    """(m, l, o) of each row's own part: grouped [B, KV, G, D], own_k/v [B, Sc, KV, D], own_visible
    [B, Sc] -> m, l [B, KV, G] and o [B, KV, G, D] (f32)."""
    scores = jnp.einsum("bkgd,bskd->bskg", grouped, own_k, preferred_element_type=jnp.float32)
    peak, p = _part(scores * grouped.shape[-1] ** -0.5, own_visible)
    out = jnp.einsum("bskg,bskd->bkgd", p.astype(own_v.dtype), own_v, preferred_element_type=jnp.float32)
    return peak, jnp.sum(p, axis=1), out


def merge(a, b) -> jax.Array:
    """The softmax over two parts from their (m, l, o) (the module doc's formula)."""
    (peak_a, sum_a, out_a), (peak_b, sum_b, out_b) = a, b
    peak = jnp.maximum(peak_a, peak_b)
    scale_a, scale_b = jnp.exp(peak_a - peak), jnp.exp(peak_b - peak)
    total = scale_a * sum_a + scale_b * sum_b
    out = scale_a[..., None] * out_a + scale_b[..., None] * out_b
    return out / jnp.where(total > 0, total, 1.0)[..., None]  # total 0 only for a row with no visible slot


def cascade_attention(q: jax.Array, prompt_k: jax.Array, prompt_v: jax.Array, prompt_visible: jax.Array,
                      own_k: jax.Array, own_v: jax.Array, own_visible: jax.Array) -> jax.Array:
    """softmax over (prompt, own) slots of one query token per row: q [P*n, N, D]; prompt_k/v
    [P, Sp, KV, D], prompt_visible [P, Sp]; own_k/v [P*n, Sc, KV, D], own_visible [P*n, Sc]
    -> [P*n, N, D]. Rows p*n .. p*n+n-1 share prompt p."""
    grouped = grouped_queries(q, prompt_k.shape[2])  # [B, KV, G, D]
    groups = prompt_k.shape[0]
    shared = prompt_part(grouped.reshape(groups, -1, *grouped.shape[1:]), prompt_k, prompt_v, prompt_visible)
    shared = tuple(a.reshape(grouped.shape[0], *a.shape[2:]) for a in shared)
    out = merge(shared, own_part(grouped, own_k, own_v, own_visible))
    return out.reshape(q.shape).astype(q.dtype)


def table_attention(q: jax.Array, group: jax.Array, member: jax.Array, members: int, prompt_k: jax.Array,
                    prompt_v: jax.Array, prompt_visible: jax.Array, own_k: jax.Array, own_v: jax.Array,
                    own_visible: jax.Array) -> jax.Array:
    """`cascade_attention` with rows mapped to a prompt table: row b's prompt is table slot
    group[b] of prompt_k/v [G, Sp, KV, D], where it is member[b] < members (a row with group = G
    has no prompt). The rows' queries are scattered into [G, members, KV, G, D], the prompt part
    runs once per table slot as in `cascade_attention`, and its (m, l, o) is gathered back."""
    grouped = grouped_queries(q, prompt_k.shape[2])  # [B, KV, G, D]
    table = jnp.zeros((prompt_k.shape[0], members) + grouped.shape[1:], grouped.dtype)
    table = table.at[group, member].set(grouped, mode="drop")
    peak, total, out = prompt_part(table, prompt_k, prompt_v, prompt_visible)
    shared = (peak.at[group, member].get(mode="fill", fill_value=_MASKED),
              total.at[group, member].get(mode="fill", fill_value=0.0),
              out.at[group, member].get(mode="fill", fill_value=0.0))
    out = merge(shared, own_part(grouped, own_k, own_v, own_visible))
    return out.reshape(q.shape).astype(q.dtype)


@struct.dataclass
class TableCache:
    """Partial-rollout slots on a prompt table: prompt [L, G, Tp, KV, D], mask [G, Tp], one
    table slot per live group; completion [L, N, Tc, KV, D], each slot's own tokens; row r's
    group is table slot group[r] (G: none), where it is member[r] < members."""

    prompt: KVCache
    completion: KVCache
    group: jax.Array  # [N] int32
    member: jax.Array  # [N] int32
    members: int = struct.field(pytree_node=False, default=1)

    @property
    def max_len(self) -> int:
        """Slots a row sees: its group's prompt and its own."""
        return self.prompt.max_len + self.completion.max_len

    def lengths(self) -> jax.Array:
        """[N] real tokens cached per row = the position of each row's next token."""
        prompt = self.prompt.lengths().at[self.group].get(mode="fill", fill_value=0)
        return prompt + self.completion.lengths()

    def with_new_tokens(self, token_mask: jax.Array) -> "TableCache":
        return with_new_own_tokens(self, token_mask)

    def windowed(self, own_visible: jax.Array, window: jax.Array | None,
                 query: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
        """(prompt [G, members, Tp], own [B, view]) slots each row's query sees through a sliding window,
        counted in positions: rows sit at different depths, and a kept row's own slots hold empty ones
        between its tokens (grpo_rollout.kept_cache). query [B]: each row's query position (None: that
        of its newest token)."""
        if window is None:
            return self.prompt.mask, own_visible
        query = self.lengths() - 1 if query is None else query
        own_start = self.prompt.lengths().at[self.group].get(mode="fill", fill_value=0)  # [B]
        own_seen = jnp.cumsum(self.completion.mask[:, :own_visible.shape[1]], axis=1, dtype=jnp.int32)
        own = own_visible & (query[:, None] - (own_start[:, None] + own_seen - 1) < window)
        rows = jnp.zeros((self.prompt.mask.shape[0], self.members), jnp.int32)
        rows = rows.at[self.group, self.member].set(query, mode="drop")  # [G, members]: as the queries
        prompt_seen = jnp.cumsum(self.prompt.mask, axis=1, dtype=jnp.int32)  # [G, Tp]: a slot's position + 1
        prompt = self.prompt.mask[:, None, :] & (rows[:, :, None] - (prompt_seen[:, None, :] - 1) < window)
        return prompt, own

    def advance(self, num_tokens: int) -> "TableCache":
        return self.replace(completion=self.completion.advance(num_tokens))

    def attention(self, q, prompt_k, prompt_v, own_k, own_v, own_visible, prompt_visible=None) -> jax.Array:
        """prompt_visible [G, Tp], or [G, members, Tp] per row (`windowed`); None: every real slot."""
        prompt_visible = self.prompt.mask if prompt_visible is None else prompt_visible
        return table_attention(q, self.group, self.member, self.members, prompt_k, prompt_v, prompt_visible,
                               own_k, own_v, own_visible)


def shared_decode_forward(model, tokens: jax.Array, live: jax.Array, cache,
                          layout: ActivationLayout = ActivationLayout(), view: int | None = None):
    """`grpo_rollout.attention.decode_forward` on a SharedCache or TableCache: the new token's keys and
    values go to the row's completion cache; the attention merges the prompt part and the row's own.
    view: attend over completion slots [:view] only (None: all). Returns (hidden [B, 1, H], cache).
    A sliding window is counted in slots on a SharedCache, in positions on a TableCache (`windowed`)."""
    return routed_shared_decode_forward(model, tokens, live, cache, layout, view)[:2]


def routed_shared_decode_forward(model, tokens: jax.Array, live: jax.Array, cache,
                                 layout: ActivationLayout = ActivationLayout(), view: int | None = None):
    """`shared_decode_forward` plus the routing of `grpo_rollout.attention.routed_decode_forward`."""
    return routed_decode_forward(model, tokens, live, cache, layout, cascade_over, view)


def cascade_over(cache, view: int | None = None):
    """The attend function of grpo_rollout.attention.decode_layers over a SharedCache or TableCache:
    the new keys and values go to the rows' completion part, the attention is the cache's own
    (`cascade_attention` or `table_attention`)."""
    own_visible = cache.completion.visibility(1)[:, 0, :view]  # [B, view]
    prompt = cache.prompt

    def attend(i, cache, q, k, v, window=None):
        own = cache.completion.write_layer(i, k, v)
        own_k, own_v = own.k[i, :, :view], own.v[i, :, :view]  # a static slice: only it is read
        prompt_visible, visible = (None, own_visible) if window is None else cache.windowed(own_visible, window)
        attended = cache.attention(q, prompt.k[i].astype(q.dtype), prompt.v[i].astype(q.dtype),
                                   own_k.astype(q.dtype), own_v.astype(q.dtype), visible, prompt_visible)
        return attended, cache.replace(completion=own)

    return attend


def table_prefill_forward(model, ids: jax.Array, mask: jax.Array, cache: TableCache) -> TableCache:
    """Several tokens per row into its own cache at [index, index + A): ids, mask [B, A] (left-padded;
    a masked slot stays invisible). Each layer runs as the model's does (its RoPE tables and sliding
    window, the family's post-norms and embedding scale); each query attends over its row's prompt in
    the table and the row's own slots up to itself, merged as in `table_attention`."""
    width = ids.shape[1]
    positions = jnp.maximum(cache.lengths()[:, None] + jnp.cumsum(mask, axis=1) - 1, 0)  # as the model counts them
    cos, sin = model.rope(positions)
    cache = cache.replace(completion=cache.completion.with_new_tokens(mask))
    attend = table_queries(cache, positions)

    def step(layer, i, carry):
        (x, own), (cos_i, sin_i, window) = carry, model.layer_tables(i, cos, sin)
        q, k, v = layer.self_attn.project_qkv(layer.input_layernorm(x), cos_i, sin_i)
        own = own.write_layer(i, k, v)
        x = layer.add_attention(x, layer.self_attn.o_proj(attend(i, own, q, window)))
        return layer.add_mlp(x), own

    x = model.scale_embeddings(jnp.take(model.embed_tokens.embedding[...], ids, axis=0))
    _, own = model.over_layers(step, (x, cache.completion))
    return cache.replace(completion=own.advance(width))


def table_queries(cache: TableCache, positions: jax.Array):
    """attend(i, own, q [B, A, N, D], window) -> [B, A, N, D]: layer i's queries at positions [B, A]
    over their rows' prompts in the table and own slots `own` up to themselves (one query position at
    a time), within the layer's sliding window counted in positions."""
    visible = cache.completion.visibility(positions.shape[1])  # [B, A, S]
    prompt = cache.prompt

    def attend(i, own, q, window):
        pk, pv, ok, ov = (a[i].astype(q.dtype) for a in (prompt.k, prompt.v, own.k, own.v))

        def one(q_t, visible_t, query_t):
            prompt_visible, own_visible = cache.windowed(visible_t, window, query_t)
            return cache.attention(q_t, pk, pv, ok, ov, own_visible, prompt_visible)

        return jax.vmap(one, in_axes=(1, 1, 1), out_axes=1)(q, visible, positions)

    return attend
