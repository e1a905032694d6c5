"""`grpo-bench rollout --partial-budget B`: partial against synchronous rollouts, same run.

Both sides decode the same rows (`--batch` = prompts x `--n`) of a model whose stop token
has probability `--stop-p` per step (grpo_rollout.length_model: geometric lengths, mean
~1/p, cut at `--new-tokens`). Synchronous: each step rolls out `--batch / --n` fresh
prompts and waits for its longest row. Partial: each step runs rounds of at most B decode
steps until `--batch / --n` groups are complete (grpo_rollout.partial), one side per
`--kv-cache` mode (how a carried row continues: rollout.partial.kv_cache). The sides' steps
alternate. Reported per side, over `--steps` steps after `--warmup` untimed ones (and after
every prompt width is compiled): completion tokens kept per second of rollout and slot
utilisation; `speedup_<mode>` is a partial side's tokens per second over the synchronous
one's (`speedup` and `partial`: the first mode's).
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from typing import Any

import numpy as np


def build_rollout(args: argparse.Namespace):
    import jax

    from grpo_core.contracts import Policy
    from grpo_rollout.backend import JaxRollout, JaxRolloutOptions
    from grpo_rollout.bench_model import bench_model

    args.tied = False  # the length model sets the stop token's column of an untied head
    model = bench_model(args)
    rollout = JaxRollout(JaxRolloutOptions(prompt_buckets=prefix_buckets(args)))
    rollout.load_weights(Policy.of(model))
    return rollout, jax


def prefix_buckets(args: argparse.Namespace) -> tuple[int, ...]:
    """Prompt widths every --bucket-step tokens up to the longest carried prefix: a prefix
    grows by the budget each round, and power-of-two buckets would pad 257 tokens to 512."""
    longest = args.prompt_len + args.new_tokens - 1
    return tuple(range(args.bucket_step, longest + args.bucket_step, args.bucket_step))


def prompt_source(args: argparse.Namespace):
    """draw() for the pool and `batch(count)` for synchronous steps: random prompts of
    --prompt-len tokens (never the stop token)."""
    rng = np.random.default_rng(args.seed)

    def prompt() -> list[int]:
        tokens = rng.integers(0, args.vocab - 1, size=args.prompt_len)
        return np.where(tokens >= args.eos, tokens + 1, tokens).tolist()

    return lambda: [({"id": "random"}, prompt())], prompt


def run_bench(args: argparse.Namespace) -> dict[str, Any]:
    from grpo_core.contracts import SamplingParams

    if args.eos is None or args.stop_p is None:
        raise SystemExit("grpo-bench rollout: --partial-budget needs --eos ID and --stop-p P (the length model)")
    rollout, jax = build_rollout(args)
    sampling = SamplingParams(max_new_tokens=args.new_tokens, temperature=args.temperature, n=args.n,
                              stop_token_ids=(args.eos,))
    round_sampling = SamplingParams(max_new_tokens=args.partial_budget, temperature=args.temperature, n=1,
                                    stop_token_ids=(args.eos,))  # max_new_tokens: each round's budget
    sides = {"synchronous": synchronous_stepper(args, rollout, sampling, jax)}
    modes = list(dict.fromkeys(args.kv_cache))
    for mode in modes:  # each its own backend: a kept cache is one pool's slots
        sides[f"partial_{mode}"] = partial_stepper(args, build_rollout(args)[0], round_sampling, jax, mode)
    records = interleaved(args, sides)
    sync = records["synchronous"]
    speedups = {f"speedup_{mode}": records[f"partial_{mode}"]["tokens_per_s"] / sync["tokens_per_s"] for mode in modes}
    return {"mode": "partial_vs_synchronous", "speedup": speedups[f"speedup_{modes[0]}"], **speedups,
            "partial": records[f"partial_{modes[0]}"], **records, "kv_cache": modes, "steps": args.steps,
            "budget": args.partial_budget,
            "budget_quantile": args.partial_quantile, "stop_p": args.stop_p, "n": args.n,
            "backend": jax.default_backend()}


def interleaved(args, sides: dict) -> dict[str, dict[str, Any]]:
    """The sides' steps alternate, so a machine shared with other work slows both alike."""
    from grpo_core.rollout_records import DecodeTally

    tallies = {name: DecodeTally() for name in sides}
    kept, seconds = dict.fromkeys(sides, 0), dict.fromkeys(sides, 0.0)
    for step in range(args.warmup + args.steps):
        for name, one_step in sides.items():
            timed = step >= args.warmup
            start = time.perf_counter()
            tokens, work = one_step(step)
            if timed:
                seconds[name] += time.perf_counter() - start
                kept[name] += tokens
                tallies[name] += work
    return {name: side_record(tallies[name], kept[name], seconds[name], args.steps) for name in sides}


def synchronous_stepper(args, rollout, sampling, jax):
    """step(index) -> (completion tokens kept, decode work): fresh prompts, every row to its end."""
    from grpo_core.rollout_records import DecodeTally

    _, prompt = prompt_source(args)

    def one_step(step: int) -> tuple[int, DecodeTally]:
        result = rollout.generate([prompt() for _ in range(args.batch // args.n)], jax.random.key(step), sampling)
        lengths = np.asarray(result.lengths)
        return int(lengths.sum()), DecodeTally.synchronous(lengths)
    return one_step


def partial_stepper(args, rollout, round_sampling, jax, kv_cache: str):
    """step(index) -> (completion tokens kept, decode work): the complete groups of one partial step
    (carried rows re-prefilled, or continued from their kept KV cache: rollout.partial.kv_cache)."""
    from grpo_core.rollout_records import DecodeTally
    from grpo_rollout.partial import PartialPool

    draw, _ = prompt_source(args)
    def generate(prefixes, key, budget: int, cached):
        sampling = dataclasses.replace(round_sampling, max_new_tokens=budget)
        if kv_cache != "reprefill":
            return rollout.generate_round(prefixes, cached, key, sampling)
        return rollout.generate(prefixes, key, sampling)

    compile_prefix_widths(args, generate, jax, kv_cache != "reprefill")
    pool = PartialPool(args.batch, args.n, args.partial_budget, args.new_tokens,
                       budget_quantile=args.partial_quantile, kv_cache=kv_cache)

    def one_step(step: int) -> tuple[int, DecodeTally]:
        groups, stats = pool.step(generate, draw, jax.random.key(step), step, args.batch // args.n)
        return sum(len(row.tokens) for group in groups for row in group.rows), stats.decode
    return one_step


def compile_prefix_widths(args, generate, jax, kept: bool) -> None:
    """One round at every prompt bucket a carried prefix can reach and every budget a round can
    take, so no timed step compiles (kept cache: every kept width, with and without admitted
    prompts)."""
    longest = args.prompt_len + args.new_tokens - 1
    for width in prefix_buckets(args):
        for budget in round_budgets(args) if width >= args.prompt_len else []:
            prefix = [1] * min(width, longest)
            generate([prefix] * args.batch, jax.random.key(0), budget, [False] * args.batch)
            if not kept:
                continue
            mixed = [prefix[:args.prompt_len] if i % 2 else prefix for i in range(args.batch)]
            generate(mixed, jax.random.key(0), budget, [i % 2 == 0 for i in range(args.batch)])
            generate([prefix] * args.batch, jax.random.key(0), budget, [True] * args.batch)


def round_budgets(args) -> list[int]:
    """Every budget a round can take: the cap, and with a quantile the powers of two below it."""
    cap = args.partial_budget
    return [cap] if args.partial_quantile is None else sorted({min(1 << i, cap) for i in range(cap.bit_length() + 1)})


def side_record(tally, kept: int, seconds: float, steps: int) -> dict[str, Any]:
    return {"tokens_per_s": kept / seconds, "tokens_kept": kept, "rollout_s": seconds,
            "slot_utilisation": tally.sampled_tokens / tally.slot_steps,
            "decode_steps_per_step": tally.decode_steps / steps}
