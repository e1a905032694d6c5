"""The kernel parts of `grpo-bench gpu` (grpo_runner_gsm8k.commands.gpu_acceptance): decode tokens/s (also
on 8-bit weights and caches), the loss implementations and cuDNN against chunked attention. Each returns the fields of its record;
`shapes` is a gpu_acceptance.Shapes."""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp


DECODE_FIELDS = ("tokens_per_s", "prefill_ms", "decode_ms_per_token", "decode_steps")
FP8_CAPABILITY = 8.9  # NVIDIA compute capability with fp8 (e4m3) tensor cores: L4/Ada 8.9, H100/H200 9.0


def decode_args(shapes: Any):
    """grpo-bench rollout's arguments for the jax backend at 64 rows of the preset's model."""
    from grpo_rollout.bench import parse_args as rollout_args

    arch = shapes.architecture
    argv = ["--hidden", arch["hidden_size"], "--layers", arch["num_hidden_layers"], "--heads",
            arch["num_attention_heads"], "--kv-heads", arch["num_key_value_heads"], "--intermediate",
            arch["intermediate_size"], "--vocab", arch["vocab_size"], "--tied", "--dtype", "bfloat16", "--batch", 64,
            "--prompt-len", shapes.prompt_tokens, "--new-tokens", shapes.decode_new_tokens, "--repeats", 2]
    return rollout_args([str(a) for a in argv])


def decode_part(shapes: Any) -> dict:
    """grpo-bench rollout's measurement of the jax backend at 64 rows of the preset's model."""
    from grpo_rollout.bench import bench_jax

    found = bench_jax(decode_args(shapes))
    return {"rows": 64, "prompt_tokens": shapes.prompt_tokens, "new_tokens": shapes.decode_new_tokens,
            **{k: found[k] for k in DECODE_FIELDS}}


def fp8_missing(device: Any, gpu: bool) -> str | None:
    """Why `device` cannot run the fp8 sides (a GPU older than FP8_CAPABILITY), or None. Other
    backends run them (XLA:CPU computes fp8 in software: the figures check the path, not a speed)."""
    capability = getattr(device, "compute_capability", None)
    if not gpu or capability is None or float(capability) >= FP8_CAPABILITY:
        return None
    return (f"fp8 needs an NVIDIA GPU of compute capability {FP8_CAPABILITY} or newer (L4, H100, H200); "
            f"{device.device_kind} has {capability}")


def quantize_part(shapes: Any, gpu: bool) -> dict:
    """The decode part's measurement on 8-bit weights (rollout.quantize int8, fp8) and KV caches
    (rollout.kv_cache_dtype int8, fp8) beside full precision, in one run: each side's tokens/s and
    its decode speedup over full precision; fp8 sides skipped in one line on a GPU without fp8."""
    from grpo_rollout.bench import QUANTIZED_SIDES, bench_jax

    args = decode_args(shapes)
    full = bench_jax(args)
    record: dict[str, Any] = {"rows": 64, "full_precision": {k: full[k] for k in DECODE_FIELDS}}
    missing = fp8_missing(jax.devices()[0], gpu)
    for name, options in QUANTIZED_SIDES.items():
        if missing and name.startswith("fp8"):
            record[name] = {"status": "skipped", "reason": missing}
            continue
        side = bench_jax(args, **options)
        record[name] = {"status": "ok", **{k: side[k] for k in DECODE_FIELDS},
                        "decode_speedup": round(full["decode_ms_per_token"] / side["decode_ms_per_token"], 3)}
    return record


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
