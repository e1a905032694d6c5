"""`grpo-bench rollout`: tokens/s of the `jax` rollout backend on a random Qwen model.

Prints ONE JSON line. With `--compare-hf` it also times transformers `generate` (torch
CPU, KV cache on) on the same shape in a subprocess and reports the speedup; `--engine hf`
runs only that side. Defaults are the issue's reference shape: tiny Qwen2 (hidden 256,
4 layers, 4 heads, 2 KV heads, intermediate 768, vocab 151,936, untied, f32), batch 64,
prompt 32, 128 new tokens, EOS suppressed, multinomial sampling at T=1.

    grpo-bench rollout                       # or: python -m grpo_rollout.bench
    grpo-bench rollout --compare-hf --repeats 3
    grpo-bench rollout --compare-shared --n 8 --prompt-len 256             # shared vs repeated prompts
    grpo-bench rollout --round-costs --n 8 --partial-budget 16             # a partial round's phase costs
    grpo-bench rollout --compare-segments 4 --n 8 --new-tokens 512          # 4 decode segments vs one loop
    grpo-bench rollout --eos 0 --stop-p 0.03125 --new-tokens 256 --partial-budget 24   # partial vs synchronous
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from functools import partial
from typing import Any

import numpy as np

from grpo_rollout.bench_model import bench_model, qwen_config

# glibc returns freed pages to the OS eagerly by default; torch's per-step allocations
# then page-fault on every token. These keep the heap (the tuned HF baseline).
HF_MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "4294967296", "MALLOC_TRIM_THRESHOLD_": "68719476736",
                 "MALLOC_TOP_PAD_": "1073741824"}


def add_partial_args(partial) -> None:
    partial.add_argument("--partial-budget", type=int, default=None,
                         help="compare partial rollouts (rounds of this many decode steps) with synchronous ones")
    partial.add_argument("--partial-quantile", type=float, default=None, metavar="Q",
                         help="rounds of the Q-quantile of recent lengths (power of two, at most --partial-budget)")
    partial.add_argument("--kv-cache", nargs="+", default=["within_step"], metavar="MODE",
                         choices=("reprefill", "within_step", "across_steps"),
                         help="partial sides to time, by how a carried row continues (rollout.partial.kv_cache)")
    partial.add_argument("--n", type=int, default=8, help="rows per prompt (group size)")
    partial.add_argument("--steps", type=int, default=10, help="timed steps per side")
    partial.add_argument("--warmup", type=int, default=5, help="untimed steps per side before them")
    partial.add_argument("--bucket-step", type=int, default=32, help="prompt bucket spacing of carried prefixes")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="grpo-bench rollout", description=__doc__.splitlines()[0])
    shape = p.add_argument_group("model shape")
    shape.add_argument("--model-type", choices=("qwen2", "qwen3"), default="qwen2")
    shape.add_argument("--hidden", type=int, default=256)
    shape.add_argument("--layers", type=int, default=4)
    shape.add_argument("--heads", type=int, default=4)
    shape.add_argument("--kv-heads", type=int, default=2)
    shape.add_argument("--head-dim", type=int, default=0, help="0: hidden / heads")
    shape.add_argument("--intermediate", type=int, default=768)
    shape.add_argument("--vocab", type=int, default=151936)
    shape.add_argument("--tied", action="store_true", help="tie the LM head to the embedding")
    shape.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    run = p.add_argument_group("rollout")
    run.add_argument("--batch", type=int, default=64, help="rows (prompts x n)")
    run.add_argument("--prompt-len", type=int, default=32)
    run.add_argument("--new-tokens", type=int, default=128)
    run.add_argument("--eos", type=int, default=None,
                     help="stop token id; omitted: EOS suppressed, every row decodes --new-tokens")
    run.add_argument("--temperature", type=float, default=1.0)
    run.add_argument("--top-p", type=float, default=1.0)
    run.add_argument("--top-k", type=int, default=0)
    run.add_argument("--greedy", action="store_true")
    run.add_argument("--repeats", type=int, default=3, help="timed runs after one warm-up; the best is reported")
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--decode-attention", choices=("rollout", "model"), default="rollout",
                     help="single-query decode attention of grpo_rollout, or the model's cached forward")
    run.add_argument("--stop-p", type=float, default=None,
                     help="stop-token probability per step (length model, needs --eos): geometric lengths")
    add_partial_args(p.add_argument_group("partial rollouts (grpo_rollout.bench_partial)"))
    add_comparison_args(p.add_argument_group("comparisons"))
    return p.parse_args(argv)


def add_comparison_args(group) -> None:
    group.add_argument("--engine", choices=("jax", "hf"), default="jax")
    group.add_argument("--compare-hf", action="store_true", help="also time transformers generate")
    group.add_argument("--compare-shared", action="store_true",
                       help="time batch / --n prompts of --n samples with each prompt repeated and shared "
                            "(rollout.options.shared_prompt), in one run")
    group.add_argument("--round-costs", action="store_true",
                       help="XLA's FLOPs and bytes of the widest kept-cache partial round, one cache row per slot "
                            "and on the groups' prompt table (grpo_rollout.bench_round_costs)")
    group.add_argument("--compare-segments", type=int, default=0, metavar="K",
                       help="time the decode as one loop and as K segments (rollout.options.decode_segments), "
                            "shared prompts when --n > 1, in one run")
    group.add_argument("--compare-quantize", action="store_true",
                       help="time the decode on full-precision, int8 and fp8 weights (rollout.quantize) and on "
                            "int8 and fp8 KV caches (rollout.kv_cache_dtype)")
    group.add_argument("--threads", type=int, default=0, help="torch threads for --engine hf (0: all cores)")


def random_prompts(args: argparse.Namespace) -> np.ndarray:
    rng = np.random.default_rng(args.seed)
    return rng.integers(0, args.vocab, size=(args.batch, args.prompt_len), dtype=np.int32)


# ---- jax ---------------------------------------------------------------------------------
def split_weights(model, quantize: str) -> tuple:
    """(graphdef, weights) of `model`, the weights quantized as `JaxRollout.load_weights` makes them."""
    from flax import nnx

    from grpo_rollout.quantize import quantize_weights

    graphdef, weights = nnx.split(model)
    return graphdef, quantize_weights(graphdef, weights, quantize)


def bench_rollout(args: argparse.Namespace, shared: bool | None, kv_cache: str):
    """The `jax` backend as the benchmark decodes: the args' attention, shared prompts or not, `kv_cache`."""
    from grpo_rollout.backend import JaxRollout, JaxRolloutOptions

    rollout = JaxRollout(JaxRolloutOptions(decode_attention=args.decode_attention, shared_prompt=bool(shared)))
    rollout.kv_cache_with(kv_cache)
    return rollout


def bench_jax(args: argparse.Namespace, shared: bool | None = None, segments: int = 1,
              quantize: str = "none", kv_cache: str = "auto") -> dict[str, Any]:
    """shared None: `batch` distinct prompts; else batch / n prompts of n samples each, repeated n times
    (False) or prefilled once per group (True, grpo_rollout.cascade). segments: the decode as that many
    loops (grpo_rollout.segments); quantize: of the weights (grpo_rollout.quantize); kv_cache: its dtype
    (rollout.kv_cache_dtype)."""
    import jax

    from grpo_rollout.decode import decode, prefill, prefill_shared
    from grpo_rollout.segments import run_segments
    from grpo_core.contracts import SamplingParams

    model = bench_model(args)
    n = 1 if shared is None else args.n
    stop = () if args.eos is None else (args.eos,)
    sampling = SamplingParams(max_new_tokens=args.new_tokens, temperature=args.temperature, top_p=args.top_p,
                              top_k=args.top_k, greedy=args.greedy, stop_token_ids=stop, n=n)
    graphdef, weights = split_weights(model, quantize)
    static = bench_rollout(args, shared, kv_cache).static_args(graphdef, weights, sampling, 0, None)
    prompts = random_prompts(args)[: args.batch // n]
    ids = jax.numpy.asarray(prompts if shared else np.repeat(prompts, n, axis=0))
    mask = jax.numpy.ones_like(ids)
    key = jax.random.key(args.seed)
    first = prefill_shared if shared else prefill
    temp_bytes = compiled_temp_bytes(first, decode, weights, ids, mask, key, static)

    def run_once():
        start = time.perf_counter()
        cache, state = jax.block_until_ready(first(weights, ids, mask, key, **static))
        middle = time.perf_counter()
        _, state = jax.block_until_ready(run_segments(lambda until: partial(decode, **static, until=until),
                                                      weights, cache, state, key, args.new_tokens, segments))
        end = time.perf_counter()
        lengths = np.asarray(state.lengths)
        return middle - start, end - middle, int(lengths.sum()), int(state.step), lengths

    run_once()  # compile + warm-up
    best = min((run_once() for _ in range(args.repeats)), key=lambda r: r[0] + r[1])
    return jax_record(*best, temp_bytes)


def jax_record(prefill_s: float, decode_s: float, tokens: int, steps: int, lengths: np.ndarray,
               temp_bytes: dict[str, int]) -> dict[str, Any]:
    """The JSON fields of the best timed rollout, with its waste metrics."""
    import jax

    from grpo_core.rollout_records import DecodeTally, waste_metrics

    tally = DecodeTally()
    tally.add_synchronous(lengths)
    return {**waste_metrics(tally, lengths, prefix=""),
        "engine": "jax", "tokens_per_s": tokens / (prefill_s + decode_s), "prefill_ms": prefill_s * 1e3,
        "decode_ms_per_token": decode_s * 1e3 / max(steps - 1, 1), "decode_steps": steps,
        "generated_tokens": tokens, "compiled_temp_bytes": temp_bytes, "backend": jax.default_backend(),
        "devices": jax.device_count(),
    }


def compiled_temp_bytes(prefill, decode, weights, ids, mask, key, static) -> dict[str, int]:
    """XLA's temporary buffer sizes of the two compiled phases."""
    import jax

    compiled_prefill = prefill.lower(weights, ids, mask, key, **static).compile()
    cache, state = jax.eval_shape(lambda: prefill(weights, ids, mask, key, **static))
    compiled_decode = decode.lower(weights, cache, state, key, **static).compile()
    return {"prefill": temp_size(compiled_prefill), "decode": temp_size(compiled_decode)}


def temp_size(compiled) -> int:
    analysis = compiled.memory_analysis()
    return int(getattr(analysis, "temp_size_in_bytes", -1)) if analysis is not None else -1


# ---- transformers ---------------------------------------------------------------------
def bench_hf(args: argparse.Namespace) -> dict[str, Any]:
    try:
        import torch
        import transformers
    except ImportError as e:
        raise SystemExit(f"--engine hf needs torch and transformers ({e}); install the torch CPU wheel.")
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = transformers.AutoConfig.for_model(**qwen_config(args).to_hf_dict())
    torch.manual_seed(args.seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, torch_dtype=getattr(torch, args.dtype)).eval()
    ids = torch.from_numpy(random_prompts(args).astype(np.int64))
    kwargs = hf_generate_kwargs(args)

    def run_once():
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
        return time.perf_counter() - start, out.shape[1] - ids.shape[1]

    run_once()
    seconds, new = min((run_once() for _ in range(args.repeats)), key=lambda r: r[0])
    return {"engine": "hf", "tokens_per_s": args.batch * new / seconds, "seconds": seconds,
            "new_tokens": new, "torch": torch.__version__, "torch_threads": torch.get_num_threads()}


def hf_generate_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    kwargs: dict[str, Any] = dict(max_new_tokens=args.new_tokens, use_cache=True, pad_token_id=0)
    if args.greedy:
        kwargs.update(do_sample=False)
    else:  # HF's default top_k=50 would change the distribution: set every warper explicitly
        kwargs.update(do_sample=True, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k or None)
    if args.eos is None:  # EOS suppressed: every row runs to max_new_tokens
        kwargs.update(min_new_tokens=args.new_tokens, eos_token_id=None)
    else:
        kwargs.update(eos_token_id=args.eos)
    return kwargs


def hf_in_subprocess(argv: list[str]) -> dict[str, Any]:
    env = {**os.environ, **HF_MALLOC_ENV}
    cmd = [sys.executable, "-m", "grpo_rollout.bench", *argv, "--engine", "hf"]
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.engine == "hf":
        print(json.dumps(bench_hf(args)))
        return 0
    if args.round_costs:
        from grpo_rollout.bench_round_costs import run_round_costs

        print(json.dumps({**run_round_costs(args), **shape_fields(args)}))
        return 0
    if args.partial_budget is not None:
        from grpo_rollout.bench_partial import run_bench

        print(json.dumps({**run_bench(args), **shape_fields(args)}))
        return 0
    compared = comparison(args)
    if compared is not None:
        print(json.dumps({**compared, **shape_fields(args)}))
        return 0
    result = bench_jax(args)
    result.update(shape_fields(args))
    if args.compare_hf:
        hf = hf_in_subprocess([a for a in argv if a != "--compare-hf"])
        result.update(hf_tokens_per_s=hf["tokens_per_s"], speedup_vs_hf=result["tokens_per_s"] / hf["tokens_per_s"])
    print(json.dumps(result))
    return 0


# The 8-bit sides of a decode comparison, by name: bench_jax's arguments (rollout.quantize,
# rollout.kv_cache_dtype); `grpo-bench gpu`'s quantize part runs the same sides.
QUANTIZED_SIDES = {"int8": {"quantize": "int8"}, "fp8": {"quantize": "fp8"}, "int8_kv_cache": {"kv_cache": "int8"},
                   "fp8_kv_cache": {"kv_cache": "fp8"}}


def comparison(args: argparse.Namespace) -> dict[str, Any] | None:
    """Both sides of --compare-segments, --compare-shared or --compare-quantize, timed in this one run;
    None without any."""
    if args.compare_segments:
        shared = True if args.n > 1 else None
        whole, segmented = bench_jax(args, shared), bench_jax(args, shared, args.compare_segments)
        return {"one_loop": whole, "segmented": segmented, "decode_segments": args.compare_segments, "n": args.n,
                "decode_speedup": whole["decode_ms_per_token"] / segmented["decode_ms_per_token"],
                "tokens_per_s_speedup": segmented["tokens_per_s"] / whole["tokens_per_s"]}
    if args.compare_shared:
        repeated, shared = bench_jax(args, shared=False), bench_jax(args, shared=True)
        return {"repeated_prompts": repeated, "shared_prompts": shared, "n": args.n,
                "decode_speedup": repeated["decode_ms_per_token"] / shared["decode_ms_per_token"],
                "tokens_per_s_speedup": shared["tokens_per_s"] / repeated["tokens_per_s"]}
    if args.compare_quantize:
        full = bench_jax(args)
        sides = {name: bench_jax(args, **options) for name, options in QUANTIZED_SIDES.items()}
        return {"full_precision": full, **sides,
                "decode_speedup": {name: full["decode_ms_per_token"] / side["decode_ms_per_token"]
                                   for name, side in sides.items()}}
    return None


def shape_fields(args: argparse.Namespace) -> dict[str, Any]:
    keys = ("model_type", "hidden", "layers", "heads", "kv_heads", "intermediate", "vocab", "tied", "dtype",
            "batch", "prompt_len", "new_tokens", "eos", "temperature", "top_p", "top_k", "greedy", "decode_attention")
    return {k: getattr(args, k) for k in keys}


if __name__ == "__main__":
    sys.exit(main())
