"""Router statistics of a mixture-of-experts model (qwen3_moe): per-layer expert load and the
Switch Transformer load-balancing loss, from one cache-free forward over the real tokens.

    load[l, e]    share of layer l's N * k (token, expert) assignments that expert e received
                  (each row sums to 1; 1 / E when balanced). The dispatch is dropless, so no
                  assignment is ever dropped.
    balance_loss  E * sum_e f_e * P_e, with f_e the assignments to e per token and P_e the mean
                  router probability of e, both averaged over tokens and layers before the
                  product, as transformers' `load_balancing_loss_func` (with the attention
                  mask): k when perfectly balanced, up to k * E when one expert takes all.

    agreement     with a routing record (routing replay): the share of the recorded (token, layer,
                  slot) assignments whose expert is among the router's own top-k there (order
                  within the k does not matter: the output depends on the set). The forward then
                  replays the record, as the training forward does. 1 when nothing is recorded.

Padding tokens (attention_mask 0) are left out of all three.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from grpo_core.models.qwen import QwenModel, layer_routing, positions_from_mask


@dataclass(frozen=True)
class RouterStats:
    load: jax.Array  # [L, E] float32
    balance_loss: jax.Array  # [] float32
    agreement: jax.Array | None = None  # [] float32, with a routing record only


def router_statistics(model: QwenModel, input_ids: jax.Array, attention_mask: jax.Array,
                      routing: jax.Array | None = None) -> RouterStats:
    """The module doc's statistics of `model` (a sparse-MLP family) on a [B, T] batch; `routing`
    [B, T, L, k] (-1: no record) is replayed and compared with the router's own choices."""
    cfg = model.config
    if not cfg.family.sparse_mlp:
        raise ValueError(f"router statistics need a mixture-of-experts model; model_type {cfg.model_type} has none")
    token_mask = attention_mask.astype(jnp.bool_)
    x, cos, sin = model._embedded(input_ids, positions_from_mask(token_mask))
    visible, real = model._mask(token_mask), token_mask.reshape(-1).astype(jnp.float32)
    shape = (cfg.num_hidden_layers, cfg.num_experts)

    def step(layer, i, carry):
        x, counts, probs, agreed = carry  # the decoder layer's body, keeping its router's choices
        x = x + layer.self_attn(layer.input_layernorm(x), cos, sin, visible)[0]
        normed = layer.post_attention_layernorm(x)
        p, _, experts = layer.mlp.route(normed.reshape(-1, normed.shape[-1]))
        chosen = jnp.sum(jax.nn.one_hot(experts, cfg.num_experts) * real[:, None, None], axis=(0, 1))
        replay = layer_routing(routing, i)
        agreed = agreed + (0.0 if replay is None else agreeing(experts, replay.reshape(experts.shape), real))
        return x + layer.mlp(normed, replay), counts.at[i].set(chosen), probs.at[i].set(real @ p), agreed

    _, counts, probs, agreed = model.over_layers(step, (x, jnp.zeros(shape), jnp.zeros(shape), jnp.zeros(())))
    rows = cfg.num_hidden_layers * jnp.sum(real)
    loss = cfg.num_experts * jnp.sum(jnp.sum(counts, 0) / rows * jnp.sum(probs, 0) / rows)
    return RouterStats(counts / jnp.sum(counts, axis=-1, keepdims=True), loss, replay_agreement(agreed, routing, real))


def replay_agreement(agreed: jax.Array, routing: jax.Array | None, real: jax.Array) -> jax.Array | None:
    """`agreed` over the recorded assignments; 1 when nothing is recorded (e.g. one-token
    completions: replay changed nothing); None without a record."""
    if routing is None:
        return None
    count = recorded(routing, real)
    return jnp.where(count > 0, agreed / jnp.maximum(count, 1.0), 1.0)


def agreeing(own: jax.Array, replay: jax.Array, real: jax.Array) -> jax.Array:
    """Recorded assignments (replay [N, k] >= 0, real tokens) whose expert is in `own` [N, k]."""
    member = jnp.any(replay[:, :, None] == own[:, None, :], axis=-1)
    return jnp.sum(member * (replay >= 0) * real[:, None])


def recorded(routing: jax.Array, real: jax.Array) -> jax.Array:
    """The recorded (token, layer, slot) assignments of real tokens in `routing` [B, T, L, k]."""
    return jnp.sum((routing.reshape(real.shape[0], -1) >= 0) * real[:, None])


def routing_of(model: QwenModel, input_ids: jax.Array, attention_mask: jax.Array) -> jax.Array:
    """The experts [B, T, L, k] int32 the router of each layer sent each token to in a cache-free
    forward of `model` (a sparse-MLP family): the record routing replay would replay."""
    cfg = model.config
    token_mask = attention_mask.astype(jnp.bool_)
    x, cos, sin = model._embedded(input_ids, positions_from_mask(token_mask))
    visible = model._mask(token_mask)
    chosen = jnp.zeros((cfg.num_hidden_layers, x.shape[0] * x.shape[1], cfg.num_experts_per_tok), jnp.int32)

    def step(layer, i, carry):
        x, chosen = carry
        attended = layer.self_attn(layer.input_layernorm(x), *model.layer_context(i, cos, sin, visible))[0]
        x, experts = layer.add_routed_mlp(layer.add_attention(x, attended))
        return x, chosen.at[i].set(experts)

    _, chosen = model.over_layers(step, (x, chosen))
    return jnp.moveaxis(chosen.reshape(cfg.num_hidden_layers, *input_ids.shape, -1), 0, 2)
