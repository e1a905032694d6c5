"""`grpo-bench loss`: compiled memory and speed of one loss implementation.

    grpo-bench loss --impl fused --batch 8 --time 2048 --vocab 151936 --hidden 2048
    python -m grpo_losses.bench --impl fused ...     (same, without the dispatcher)

Prints ONE JSON line. The loss is `grpo_loss` with the default `loss` config
(token_mean, entropy metric on) but `--policy-loss`, old log-probs given, and
advantages per row (per token with `--token-advantages`); fwd+bwd = its value and
gradients w.r.t. hidden and lm_head. Compilation uses only abstract shapes, so
temp bytes (XLA memory_analysis) are reported for any size; timing and the
difference to `jax` run only when the arrays fit in `--memory-budget-gib`
(default: 70% of available RAM), otherwise they are null with a note.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from grpo_core.config import LossConfig

from grpo_losses.fused import FusedLogps, FusedOptions
from grpo_losses.objective import grpo_loss
from grpo_losses.pallas_kernels import PallasLogps, PallasOptions
from grpo_losses.reference import ReferenceLogps

GIB = 1024 ** 3


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="grpo-bench loss", description=__doc__.split("\n\n")[0])
    parser.add_argument("--impl", choices=["jax", "fused", "pallas"], required=True)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--time", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--block-size", type=int, default=None, help="vocab block (default: the impl's)")
    parser.add_argument("--time-block", type=int, default=None, help="token block (default: the impl's)")
    parser.add_argument("--two-pass", action="store_true", help="fused: gradient in the backward (one_pass: false)")
    parser.add_argument("--policy-loss", choices=["clip", "cispo", "sapo"], default="clip", help="loss.policy_loss")
    parser.add_argument("--token-advantages", action="store_true", help="advantages [B, T] instead of [B]")
    parser.add_argument("--repeats", type=int, default=5, help="timed fwd+bwd runs (median reported)")
    parser.add_argument("--memory-budget-gib", type=float, default=None,
                        help="run only when arrays + temp fit (default: 70%% of available RAM)")
    parser.add_argument("--no-run", action="store_true", help="compile only: no timing, no diff")
    return parser.parse_args(argv)


def build_impl(name: str, block_size: int | None, time_block: int | None, two_pass: bool = False):
    overrides = {k: v for k, v in (("block_size", block_size), ("time_block", time_block)) if v is not None}
    if name == "fused":
        return FusedLogps(FusedOptions(**overrides, one_pass=not two_pass))
    if name == "pallas":
        return PallasLogps(PallasOptions(**overrides))
    return ReferenceLogps()


def loss_fns(impl, policy_loss: str = "clip"):
    """(fwd, fwd+bwd) of the benchmark loss, both taking the 6 input arrays."""
    cfg = LossConfig(policy_loss=policy_loss)

    def loss(hidden, lm_head, targets, mask, advantages, old_logp):
        return grpo_loss(impl, hidden, lm_head, targets, mask, advantages, old_logp, None, cfg).loss

    return jax.jit(loss), jax.jit(jax.value_and_grad(loss, (0, 1)))


def input_specs(args: argparse.Namespace) -> tuple[jax.ShapeDtypeStruct, ...]:
    dtype = jnp.dtype(args.dtype)
    b, t = args.batch, args.time
    return (jax.ShapeDtypeStruct((b, t, args.hidden), dtype), jax.ShapeDtypeStruct((args.hidden, args.vocab), dtype),
            jax.ShapeDtypeStruct((b, t), jnp.int32), jax.ShapeDtypeStruct((b, t), jnp.float32),
            jax.ShapeDtypeStruct(advantage_shape(args), jnp.float32), jax.ShapeDtypeStruct((b, t), jnp.float32))


def advantage_shape(args: argparse.Namespace) -> tuple[int, ...]:
    return (args.batch, args.time) if args.token_advantages else (args.batch,)


def make_inputs(args: argparse.Namespace):
    keys = jax.random.split(jax.random.PRNGKey(0), 5)
    dtype = jnp.dtype(args.dtype)
    b, t, h, v = args.batch, args.time, args.hidden, args.vocab
    hidden = jax.random.normal(keys[0], (b, t, h), dtype)
    lm_head = (jax.random.normal(keys[1], (h, v), jnp.float32) * (2.0 / h ** 0.5)).astype(dtype)
    old_logp = -jnp.log(float(v)) + 0.3 * jax.random.normal(keys[4], (b, t))
    return (hidden, lm_head, jax.random.randint(keys[2], (b, t), 0, v), jnp.ones((b, t), jnp.float32),
            jax.random.normal(keys[3], advantage_shape(args)), old_logp)


def compiled_bytes(fn, specs) -> dict[str, int]:
    analysis = fn.lower(*specs).compile().memory_analysis()
    return {"temp": int(analysis.temp_size_in_bytes), "arguments": int(analysis.argument_size_in_bytes),
            "outputs": int(analysis.output_size_in_bytes)}


def peak_estimate(sizes: dict[str, int]) -> int:
    return sizes["temp"] + sizes["arguments"] + sizes["outputs"]


def available_bytes() -> int:
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 8 * GIB


def median_ms(fn, inputs, repeats: int) -> float:
    jax.block_until_ready(fn(*inputs))  # warm-up (compile)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*inputs))
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def max_abs_diff(result, reference) -> dict[str, float]:
    (loss, (d_hidden, d_lm_head)), (ref_loss, (ref_hidden, ref_lm_head)) = result, reference
    diff = lambda a, b: float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
    return {"loss": diff(loss, ref_loss), "d_hidden": diff(d_hidden, ref_hidden),
            "d_lm_head": diff(d_lm_head, ref_lm_head)}


def run(args: argparse.Namespace) -> dict:
    impl = build_impl(args.impl, args.block_size, args.time_block, args.two_pass)
    fwd, fwd_bwd = loss_fns(impl, args.policy_loss)
    specs = input_specs(args)
    fwd_bytes, train_bytes = compiled_bytes(fwd, specs), compiled_bytes(fwd_bwd, specs)
    budget = args.memory_budget_gib * GIB if args.memory_budget_gib else 0.7 * available_bytes()
    record = {"impl": args.impl, "shape": {"batch": args.batch, "time": args.time, "vocab": args.vocab,
                                           "hidden": args.hidden},
              "policy_loss": args.policy_loss, "advantages": list(advantage_shape(args)),
              "dtype": args.dtype, "options": getattr(getattr(impl, "options", None), "__dict__", {}),
              "temp_bytes_fwd": fwd_bytes["temp"], "temp_bytes_fwd_bwd": train_bytes["temp"],
              "temp_mib_fwd_bwd": round(train_bytes["temp"] / 2 ** 20, 1),
              "median_fwd_bwd_ms": None, "max_abs_diff_vs_jax": None, "notes": []}
    if args.no_run:
        record["notes"].append("--no-run: compiled only")
        return record
    if peak_estimate(train_bytes) > budget:
        record["notes"].append(f"not run: needs ~{peak_estimate(train_bytes) / GIB:.1f} GiB > budget {budget / GIB:.1f} GiB")
        return record
    inputs = make_inputs(args)
    record["median_fwd_bwd_ms"] = round(median_ms(fwd_bwd, inputs, args.repeats), 2)
    result = fwd_bwd(*inputs)
    if args.impl != "jax":
        _, reference = loss_fns(ReferenceLogps(), args.policy_loss)
        reference_bytes = compiled_bytes(reference, specs)
        if peak_estimate(reference_bytes) + peak_estimate(train_bytes) <= budget:
            record["max_abs_diff_vs_jax"] = max_abs_diff(result, reference(*inputs))
        else:
            record["notes"].append("no diff: the jax reference does not fit in the memory budget")
    return record


def main(argv: Sequence[str] | None = None) -> None:
    print(json.dumps(run(parse_args(argv))))


if __name__ == "__main__":
    main()
