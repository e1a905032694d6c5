"""The kernel parts of `grpo-bench gpu` (grpo_runner_gsm8k.commands.gpu_acceptance): decode tokens/s, the
loss implementations and cuDNN against chunked attention. Each returns the fields of its record;
`shapes` is a gpu_acceptance.Shapes."""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp


def decode_part(shapes: Any) -> dict:
    """grpo-bench rollout's measurement of the jax backend at 64 rows of the preset's model."""
    from grpo_rollout.bench import bench_jax
    from grpo_rollout.bench import parse_args as rollout_args

    arch = shapes.architecture
    argv = ["--hidden", arch["hidden_size"], "--layers", arch["num_hidden_layers"], "--heads",
            arch["num_attention_heads"], "--kv-heads", arch["num_key_value_heads"], "--intermediate",
            arch["intermediate_size"], "--vocab", arch["vocab_size"], "--tied", "--dtype", "bfloat16", "--batch", 64,
            "--prompt-len", shapes.prompt_tokens, "--new-tokens", shapes.decode_new_tokens, "--repeats", 2]
    found = bench_jax(rollout_args([str(a) for a in argv]))
    return {"rows": 64, "prompt_tokens": shapes.prompt_tokens, "new_tokens": shapes.decode_new_tokens,
            **{k: found[k] for k in ("tokens_per_s", "prefill_ms", "decode_ms_per_token", "decode_steps")}}


def loss_part(shapes: Any, gpu: bool) -> dict:
    """grpo-bench loss for jax, fused and pallas (pallas only on a GPU: elsewhere it would run
    interpreted, which measures nothing)."""
    from grpo_losses.bench import parse_args as loss_args
    from grpo_losses.bench import run as loss_run

    batch, time_, vocab, hidden = shapes.loss
    record: dict[str, Any] = {"shape": {"batch": batch, "time": time_, "vocab": vocab, "hidden": hidden},
                              "dtype": "bfloat16"}
    for impl in ("jax", "fused", "pallas"):
        if impl == "pallas" and not gpu:
            record[impl] = {"status": "skipped", "reason": "not a GPU (the Triton kernel)"}
            continue
        argv = ["--impl", impl, "--batch", batch, "--time", time_, "--vocab", vocab, "--hidden", hidden,
                "--dtype", "bfloat16", "--repeats", 5]
        record[impl] = one_loss(lambda: loss_run(loss_args([str(a) for a in argv])))
    return record


def one_loss(measure: Callable[[], dict]) -> dict:
    try:
        found = measure()
    except Exception as exc:  # one implementation failing leaves the others' figures
        return {"status": "error", "error": f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"}
    return {"status": "ok" if found["median_fwd_bwd_ms"] is not None else "not run",
            "fwd_bwd_ms": found["median_fwd_bwd_ms"], "max_abs_diff_vs_jax": found["max_abs_diff_vs_jax"],
            "temp_mib_fwd_bwd": found["temp_mib_fwd_bwd"], "notes": found["notes"]}


def attention_inputs(shapes: Any) -> tuple[jax.Array, ...]:
    batch, time_, heads, kv_heads, head_dim = shapes.attention
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (batch, time_, heads, head_dim), jnp.bfloat16)
    k, v = (jax.random.normal(key, (batch, time_, kv_heads, head_dim), jnp.bfloat16) for key in keys[1:])
    return q, k, v, jnp.ones((batch, time_), jnp.bool_)


def attention_functions() -> dict[str, Callable[..., jax.Array]]:
    from grpo_core.models.attention_impls import chunked_attention, cudnn_attention

    return {"chunked": lambda q, k, v, real: chunked_attention(q, k, v, real, jnp.zeros((), jnp.int32)),
            "cudnn": cudnn_attention}


def median_ms(fn: Callable[..., Any], args: tuple, repeats: int = 5) -> float:
    jax.block_until_ready(fn(*args))  # compile
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - start) * 1e3)
    return round(statistics.median(times), 3)


def attention_part(shapes: Any, gpu: bool) -> dict:
    """Causal self-attention of one prompt pass: forward and forward + backward (gradient of the
    output's sum with respect to q, k, v), cuDNN against chunked."""
    batch, time_, heads, kv_heads, head_dim = shapes.attention
    inputs = attention_inputs(shapes)
    record: dict[str, Any] = {"shape": {"batch": batch, "time": time_, "heads": heads, "kv_heads": kv_heads,
                                        "head_dim": head_dim}, "dtype": "bfloat16"}
    outputs = {}
    for name, fn in attention_functions().items():
        if name == "cudnn" and not gpu:
            record[name] = {"status": "skipped", "reason": "not a GPU (cuDNN)"}
            continue
        forward = jax.jit(fn)
        backward = jax.jit(jax.grad(lambda q, k, v, real: jnp.sum(fn(q, k, v, real).astype(jnp.float32)), (0, 1, 2)))
        record[name] = {"status": "ok", "fwd_ms": median_ms(forward, inputs), "fwd_bwd_ms": median_ms(backward, inputs)}
        outputs[name] = forward(*inputs).astype(jnp.float32)
    if len(outputs) == 2:
        record["max_abs_diff"] = float(jnp.max(jnp.abs(outputs["cudnn"] - outputs["chunked"])))
    return record
