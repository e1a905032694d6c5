"""A length model for tests and benchmarks: a Qwen model whose stop token has a chosen
per-step probability p, so completion lengths are geometric (mean ~ 1/p, a heavy tail cut
at max_new_tokens) without a trained model.

The layers' output projections are zeroed and every embedding row is the same vector, so
the final hidden state h is one constant vector whatever the context; the stop token's
column of the (untied) LM head is then set along h so that softmax(h @ W / T) gives it
exactly p. Every decode step still runs every layer: the cost per token is that of any
model of the same shape.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


def geometric_stop_model(model: nnx.Module, stop_token: int, p: float, temperature: float = 1.0) -> nnx.Module:
    """Rewrites `model` (a grpo_core QwenModel with an untied LM head) in place so every
    sampled token is `stop_token` with probability p at `temperature`; returns it."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"stop probability p={p} must be in (0, 1).")
    if model.lm_head is None:
        raise ValueError("geometric_stop_model needs an untied LM head (tie_word_embeddings: false).")
    if not 0 <= stop_token < model.config.vocab_size:
        raise ValueError(f"stop_token={stop_token} is outside the vocabulary [0, {model.config.vocab_size}).")
    _silence_layers(model)
    table = model.embed_tokens.embedding
    table[...] = jnp.broadcast_to(table[...][:1], table.shape)
    hidden = model.norm(table[...][:1][None])[0, 0].astype(jnp.float32)  # [H], the same after any context
    kernel = model.lm_head.kernel
    kernel[...] = stop_column(kernel[...], hidden, stop_token, p, temperature)
    return model


def _silence_layers(model: nnx.Module) -> None:
    """Zero what the layers write into the residual stream: it stays the token embedding."""
    for projection in (model.layers.self_attn.o_proj, model.layers.mlp.down_proj):
        projection.kernel[...] = jnp.zeros_like(projection.kernel[...])
        if getattr(projection, "bias", None) is not None:
            projection.bias[...] = jnp.zeros_like(projection.bias[...])


def stop_column(kernel: jax.Array, hidden: jax.Array, stop_token: int, p: float, temperature: float) -> jax.Array:
    """kernel [H, V] with column `stop_token` set along `hidden` [H] so that
    softmax(hidden @ kernel / T)[stop_token] = p: its logit is T * (log(p / (1 - p)) + the
    logsumexp of the other tokens' scaled logits)."""
    scaled = hidden @ kernel.astype(jnp.float32) / temperature  # [V]
    others = jax.nn.logsumexp(scaled.at[stop_token].set(-jnp.inf))
    logit = temperature * (jnp.log(p) - jnp.log1p(-p) + others)
    column = hidden * logit / jnp.dot(hidden, hidden)
    return kernel.at[:, stop_token].set(column.astype(kernel.dtype))
