"""Forward-pass benchmark: prints one JSON line with tokens/s and compiled temp memory.

    grpo-bench model --preset qwen2.5-0.5b --batch 4 --seq 512 --dtype bfloat16
    grpo-bench model --hidden 256 --intermediate 768 --layers 4 --heads 4 --kv-heads 2 \
        --batch 16 --seq 200 --dtype float32 --train --attention chunked
    python -m grpo_core.models.bench --family qwen3 --hidden 256 --layers 4 --heads 4 \
        --kv-heads 2 --intermediate 768 --vocab 4096 --batch 8 --seq 256

Shape flags override the preset (default: the tiny preset of --family). Weights are
random; the timed function is the jitted decoder forward to final hidden states (the LM
head is excluded: losses fuse it), or with --train the forward and backward (gradient of
the mean square of the hidden states). Tokens/s is batch * seq / median step time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
from flax import nnx

from grpo_core.model_families import family_named
from grpo_core.models.attention_impls import ATTENTION_CHOICES, resolve_attention
from grpo_core.models.config import QwenConfig
from grpo_core.models.presets import PRESETS
from grpo_core.models.qwen import DTYPES, REMAT_MODES, init_from_config

_SHAPE_FLAGS = {
    "hidden": "hidden_size",
    "layers": "num_hidden_layers",
    "heads": "num_attention_heads",
    "kv_heads": "num_key_value_heads",
    "head_dim": "head_dim",
    "intermediate": "intermediate_size",
    "vocab": "vocab_size",
}


def argument_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="grpo-bench model", description=__doc__.split("\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), help="model shape preset (default tiny-<family>)")
    p.add_argument("--family", choices=[name.removeprefix("tiny-") for name in PRESETS if name.startswith("tiny-")], default=None, help="model family (default qwen2)")
    for flag in _SHAPE_FLAGS:
        p.add_argument(f"--{flag.replace('_', '-')}", dest=flag, type=int, default=None)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    p.add_argument("--remat", choices=REMAT_MODES, default="none")
    p.add_argument("--attention", choices=ATTENTION_CHOICES, default="xla", help="multi-token attention")
    p.add_argument("--train", action="store_true", help="time forward + backward instead of the forward")
    p.add_argument("--iters", type=int, default=5, help="timed iterations after one warm-up call")
    return p


def build_config(args: argparse.Namespace) -> QwenConfig:
    preset = args.preset or f"tiny-{args.family or 'qwen2'}"
    cfg = PRESETS[preset]
    changes = {field: getattr(args, flag) for flag, field in _SHAPE_FLAGS.items() if getattr(args, flag) is not None}
    if args.family and args.family != cfg.model_type:
        changes.update(model_type=args.family, attention_bias=None)
    if "hidden_size" in changes or "num_attention_heads" in changes:
        explicit = family_named(args.family or cfg.model_type).writes_head_dim
        changes.setdefault("head_dim", cfg.head_dim if explicit else 0)
    return cfg.replace(**changes)


def _time_forward(compiled, state, ids, mask, iters: int) -> list[float]:
    jax.block_until_ready(compiled(state, ids, mask))  # warm-up
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(compiled(state, ids, mask))
        times.append(time.perf_counter() - start)
    return times


def run(args: argparse.Namespace) -> dict:
    cfg = build_config(args)
    model = init_from_config(cfg, seed=0, dtype=args.dtype, remat=args.remat)
    attention = resolve_attention(args.attention, args.dtype)
    model.set_attention(attention)
    graphdef, state = nnx.split(model)
    ids = jnp.zeros((args.batch, args.seq), jnp.int32)
    mask = jnp.ones((args.batch, args.seq), jnp.int32)

    def forward(state, ids, mask):
        return nnx.merge(graphdef, state)(ids, attention_mask=mask)

    def train_step(state, ids, mask):
        return jax.grad(lambda s: jnp.mean(jnp.square(forward(s, ids, mask).astype(jnp.float32))))(state)

    start = time.perf_counter()
    compiled = jax.jit(train_step if args.train else forward).lower(state, ids, mask).compile()
    compile_s = time.perf_counter() - start
    memory = compiled.memory_analysis()
    times = _time_forward(compiled, state, ids, mask, args.iters)
    median = statistics.median(times)
    return {
        "bench": "model_train_step" if args.train else "model_forward",
        "backend": jax.default_backend(),
        "device": jax.devices()[0].device_kind,
        "preset": args.preset,
        "family": cfg.model_type,
        "params": model.num_params(),
        "shape": {k: getattr(cfg, v) for k, v in _SHAPE_FLAGS.items()},
        "batch": args.batch,
        "seq": args.seq,
        "dtype": args.dtype,
        "remat": args.remat,
        "attention": attention,
        "iters": args.iters,
        "step_ms_median" if args.train else "forward_ms_median": round(median * 1e3, 3),
        "step_tokens_per_s" if args.train else "forward_tokens_per_s": round(args.batch * args.seq / median, 1),
        "compile_s": round(compile_s, 2),
        "compiled_temp_bytes": None if memory is None else int(memory.temp_size_in_bytes),
    }


def main(argv: list[str] | None = None) -> int:
    args = argument_parser().parse_args(argv)
    print(json.dumps(run(args)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
