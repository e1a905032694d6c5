"""Analytic matmul FLOPs of the Qwen forward and of one decode step (matmuls only;
q = heads * head_dim, kv = kv_heads * head_dim):

    P_layer          = H*q + 2*H*kv + q*H + M               (q, k, v, o; M the MLP's weights per token:
                                                            3*H*I dense, H*E + 3*H*I_moe*k for top-k of
                                                            E experts, from the model family)
    forward(N, T, C) = 2*L*P_layer*N*T                      decoder layers, all T columns
                     + 2*L*q*N*T*(T+1)                      QK^T and PV over the causal pairs
                     + 2*H*V*N*C                            LM head, completion columns only
    decode step      = 2*L*P_layer*N + 4*L*q*N*S + 2*H*V*N  (S = cache slots attended)
"""

from __future__ import annotations

from grpo_core.models import QwenConfig


def layer_params(q: QwenConfig) -> int:
    """Matmul weights of one decoder layer that multiply each token (a MoE layer's active ones)."""
    heads, kv = q.num_attention_heads * q.head_dim, q.num_key_value_heads * q.head_dim
    return q.hidden_size * heads + 2 * q.hidden_size * kv + heads * q.hidden_size + q.family.mlp_matmul_params(q)


def forward_flops(q: QwenConfig, rows: int, width: int, completion: int) -> float:
    """Matmul FLOPs of the training forward (module doc)."""
    heads = q.num_attention_heads * q.head_dim
    layers = 2.0 * q.num_hidden_layers * layer_params(q) * rows * width
    attention = 2.0 * q.num_hidden_layers * heads * rows * width * (width + 1)
    return layers + attention + 2.0 * q.hidden_size * q.vocab_size * rows * completion


def decode_step_flops(q: QwenConfig, rows: int, slots: int) -> float:
    """Matmul FLOPs of one decoded token per row against `slots` cache slots."""
    heads = q.num_attention_heads * q.head_dim
    return rows * (2.0 * q.num_hidden_layers * layer_params(q) + 4.0 * q.num_hidden_layers * heads * slots
                   + 2.0 * q.hidden_size * q.vocab_size)
