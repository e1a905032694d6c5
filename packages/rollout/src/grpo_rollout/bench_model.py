"""The random Qwen model `grpo-bench rollout` decodes with (both the synchronous and the
partial-rollout sides), built from the bench's command-line shape."""

from __future__ import annotations

import argparse


def qwen_config(args: argparse.Namespace):
    from grpo_core.models import QwenConfig

    return QwenConfig(
        model_type=args.model_type, vocab_size=args.vocab, hidden_size=args.hidden,
        intermediate_size=args.intermediate, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, head_dim=args.head_dim,
        tie_word_embeddings=args.tied, max_position_embeddings=max(4096, args.prompt_len + args.new_tokens),
        torch_dtype=args.dtype, rope_theta=10_000.0,
    )


def bench_model(args: argparse.Namespace):
    """The bench's random model; with --stop-p, the length model (geometric lengths)."""
    from grpo_core.models import init_from_config

    model = init_from_config(qwen_config(args), seed=args.seed, dtype=args.dtype)
    if args.stop_p is None:
        return model
    from grpo_rollout.length_model import geometric_stop_model

    return geometric_stop_model(model, args.eos, args.stop_p, args.temperature)
