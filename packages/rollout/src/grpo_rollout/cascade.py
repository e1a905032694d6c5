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
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from grpo_core.models.attention import KVCache
from grpo_rollout.attention import decode_inputs, decode_layers
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


def _part(scores: jax.Array, visible: jax.Array):
    """(m, p) of one part: scores [X, S, ...] masked by visible [X, S], m its max over S, p the
    shifted exponentials (0 where not visible)."""
    visible = visible.reshape(visible.shape + (1,) * (scores.ndim - 2))
    scores = jnp.where(visible, scores, _MASKED)
    peak = jnp.max(scores, axis=1, keepdims=True)
    return peak[:, 0], jnp.where(visible, jnp.exp(scores - peak), 0.0)


def cascade_attention(q: jax.Array, prompt_k: jax.Array, prompt_v: jax.Array, prompt_visible: jax.Array,
                      own_k: jax.Array, own_v: jax.Array, own_visible: jax.Array) -> jax.Array:
    """softmax over (prompt, own) slots of one query token per row: q [P*n, N, D]; prompt_k/v
    [P, Sp, KV, D], prompt_visible [P, Sp]; own_k/v [P*n, Sc, KV, D], own_visible [P*n, Sc]
    -> [P*n, N, D]. Query head h uses KV head h // G (HF repeat_kv order)."""
    rows, heads, dim = q.shape
    groups, kv_heads = prompt_k.shape[0], prompt_k.shape[2]
    grouped = q.reshape(groups, rows // groups, kv_heads, heads // kv_heads, dim)  # [P, n, KV, G, D]
    shared_scores = jnp.einsum("pnkgd,pskd->psnkg", grouped, prompt_k, preferred_element_type=jnp.float32)
    shared_peak, shared_p = _part(shared_scores * dim**-0.5, prompt_visible)  # [P, n, KV, G], [P, S, n, KV, G]
    shared_out = jnp.einsum("psnkg,pskd->pnkgd", shared_p.astype(prompt_v.dtype), prompt_v,
                            preferred_element_type=jnp.float32)
    own_scores = jnp.einsum("bkgd,bskd->bskg", grouped.reshape(rows, kv_heads, -1, dim), own_k,
                            preferred_element_type=jnp.float32)
    own_peak, own_p = _part(own_scores * dim**-0.5, own_visible)  # [B, KV, G], [B, S, KV, G]
    own_out = jnp.einsum("bskg,bskd->bkgd", own_p.astype(own_v.dtype), own_v, preferred_element_type=jnp.float32)
    shared_peak, shared_sum = shared_peak.reshape(own_peak.shape), jnp.sum(shared_p, axis=1).reshape(own_peak.shape)
    peak = jnp.maximum(shared_peak, own_peak)
    shared_scale, own_scale = jnp.exp(shared_peak - peak), jnp.exp(own_peak - peak)
    total = shared_scale * shared_sum + own_scale * jnp.sum(own_p, axis=1)  # [B, KV, G]
    out = shared_scale[..., None] * shared_out.reshape(own_out.shape) + own_scale[..., None] * own_out
    out = out / jnp.where(total > 0, total, 1.0)[..., None]  # total 0 only for a row with no visible slot
    return out.reshape(rows, heads, dim).astype(q.dtype)


def shared_decode_forward(model, tokens: jax.Array, live: jax.Array, cache: SharedCache,
                          layout: ActivationLayout = ActivationLayout(), view: int | None = None):
    """`grpo_rollout.attention.decode_forward` on a SharedCache: the new token's keys and values go
    to the row's completion cache; attention is `cascade_attention`. view: attend over completion
    slots [:view] only (None: all). Returns (hidden [B, 1, H], cache)."""
    x, cos, sin = decode_inputs(model, tokens, cache.lengths()[:, None], layout)
    own = cache.completion.with_new_tokens(live[:, None])
    own_visible = own.visibility(1)[:, 0, :view]  # [B, view]
    prompt = cache.prompt

    def attend(i, own, q, k, v):
        own = own.write_layer(i, k, v)
        return cascade_attention(q, prompt.k[i].astype(q.dtype), prompt.v[i].astype(q.dtype), prompt.mask,
                                 own.k[i, :, :view].astype(q.dtype), own.v[i, :, :view].astype(q.dtype),
                                 own_visible), own

    x, own = decode_layers(model, x, own, cos, sin, layout, attend)
    return model.norm(x), cache.replace(completion=own.advance(1))
