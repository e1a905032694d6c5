"""Router statistics of a mixture-of-experts model (qwen3_moe): per-layer expert load and the
Switch Transformer load-balancing loss, from one cache-free forward over the real tokens.

    load[l, e]    share of layer l's N * k (token, expert) assignments that expert e received
                  (each row sums to 1; 1 / E when balanced). The dispatch is dropless, so no
                  assignment is ever dropped.
    balance_loss  E * sum_e f_e * P_e, with f_e the assignments to e per token and P_e the mean
                  router probability of e, both averaged over tokens and layers before the
                  product, as transformers' `load_balancing_loss_func` (with the attention
                  mask): k when perfectly balanced, up to k * E when one expert takes all.

Padding tokens (attention_mask 0) are left out of both.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from grpo_core.models.qwen import QwenModel, positions_from_mask


@dataclass(frozen=True)
class RouterStats:
    load: jax.Array  # [L, E] float32
    balance_loss: jax.Array  # [] float32


def router_statistics(model: QwenModel, input_ids: jax.Array, attention_mask: jax.Array) -> RouterStats:
    """The module doc's statistics of `model` (a sparse-MLP family) on a [B, T] batch."""
    cfg = model.config
    if not cfg.family.sparse_mlp:
        raise ValueError(f"router statistics need a mixture-of-experts model; model_type {cfg.model_type} has none")
    token_mask = attention_mask.astype(jnp.bool_)
    x, cos, sin = model._embedded(input_ids, positions_from_mask(token_mask))
    visible, real = model._mask(token_mask), token_mask.reshape(-1).astype(jnp.float32)
    shape = (cfg.num_hidden_layers, cfg.num_experts)

    def step(layer, i, carry):
        x, counts, probs = carry  # the decoder layer's body, keeping its router's choices
        x = x + layer.self_attn(layer.input_layernorm(x), cos, sin, visible)[0]
        normed = layer.post_attention_layernorm(x)
        p, _, experts = layer.mlp.route(normed.reshape(-1, normed.shape[-1]))
        chosen = jnp.sum(jax.nn.one_hot(experts, cfg.num_experts) * real[:, None, None], axis=(0, 1))
        return x + layer.mlp(normed), counts.at[i].set(chosen), probs.at[i].set(real @ p)

    _, counts, probs = model.over_layers(step, (x, jnp.zeros(shape), jnp.zeros(shape)))
    rows = cfg.num_hidden_layers * jnp.sum(real)
    loss = cfg.num_experts * jnp.sum(jnp.sum(counts, 0) / rows * jnp.sum(probs, 0) / rows)
    return RouterStats(counts / jnp.sum(counts, axis=-1, keepdims=True), loss)
