"""`grpo-bench rollout --round-costs`: the widest partial-rollout round on a kept cache, compiled
with one cache row per slot and with the groups' prompt table (grpo_rollout.kept_shared), and
XLA's cost analysis of each phase: FLOPs and bytes accessed, and its time on zero inputs (best of
--repeats). The decode is a while loop, whose body XLA counts once: its FLOPs and bytes are one
decode step's (plus the loop's setup), its time the whole round's --partial-budget steps.

The round is `grpo-run --plan`'s (grpo_rollout.kept_plan): --batch slots of groups of --n rows,
prompts of --prompt-len tokens, rows carrying --new-tokens - 1 tokens, --partial-budget decode
steps; the table has `kept_shared.table_size(batch, n)` group slots.
"""

from __future__ import annotations

import argparse
from typing import Any


class CostRecorder:
    """A `grpo_core.contracts.PhaseCompiler` that compiles every phase, keeps its cost analysis and
    times it on zero inputs of its shapes (the best of `repeats` runs after a warm-up; the decode
    runs the whole round, no row stopping)."""

    def __init__(self, repeats: int) -> None:
        self.costs: dict[str, dict[str, float]] = {}
        self.repeats = repeats

    def compile(self, name: str, build, args, note=None, record: bool = True) -> Any:
        del note
        compiled = build()
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, (list, tuple)) else cost
        if record:
            self.costs[name] = {"gflop": cost.get("flops", 0.0) / 1e9, "mbytes": cost.get("bytes accessed", 0.0) / 1e6,
                                "ms": 1e3 * best_seconds(compiled, args, self.repeats)}
        return compiled

    def spare_bytes(self, compiled) -> None:
        return None

    def decode_seconds(self, compiled, steps: int) -> None:
        return None


def best_seconds(compiled, args, repeats: int) -> float:
    """The fastest of `repeats` runs of `compiled` on zeros of its arguments' shapes (fresh each run:
    some are donated), after one untimed run."""
    import time

    import jax
    import jax.numpy as jnp

    def zeros(a):
        if not isinstance(a, jax.ShapeDtypeStruct):
            return a
        if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
            return jax.random.key(0)
        return jnp.zeros(a.shape, a.dtype)

    best = float("inf")
    for run in range(repeats + 1):
        inputs = jax.tree.map(zeros, args)
        start = time.perf_counter()
        jax.block_until_ready(compiled(*inputs))
        best = min(best, time.perf_counter() - start) if run else best
    return best


def round_costs(args: argparse.Namespace, table: bool) -> dict[str, dict[str, float]]:
    import jax
    from flax import nnx

    from grpo_core.contracts import Policy, RolloutShapes, SamplingParams
    from grpo_rollout.kept_plan import compile_round
    from grpo_rollout.backend import JaxRollout, JaxRolloutOptions
    from grpo_rollout.bench_model import bench_model
    from grpo_rollout.kept_shared import table_size

    model = bench_model(args)
    rollout = JaxRollout(JaxRolloutOptions(gather_weights=False, shared_prompt=table))
    sampling = SamplingParams(max_new_tokens=args.partial_budget or 16, n=1, temperature=args.temperature)
    shapes = RolloutShapes(policy=Policy.of(model), prompts=args.batch, max_prompt_length=args.prompt_len,
                           sampling=sampling, batch_sharding=None, key=jax.random.key(0),
                           kept_prefix=args.prompt_len + args.new_tokens - 1,
                           prompt_table=(table_size(args.batch, args.n), args.n) if table else ())
    graphdef, weights = nnx.split(model)
    recorder = CostRecorder(args.repeats)
    compile_round(rollout, shapes, recorder, rollout.static_args(graphdef, weights, sampling, 0, None))
    return recorder.costs


def run_round_costs(args: argparse.Namespace) -> dict[str, Any]:
    """Both rounds' phase costs, and the prefill (the phases that run prompts) and decode ratios."""
    plain, shared = round_costs(args, table=False), round_costs(args, table=True)

    def prefill(costs):
        return sum(c["gflop"] for name, c in costs.items() if name != "rollout decode" and "compaction" not in name)

    return {"mode": "round_costs", "one_row_per_slot": plain, "prompt_table": shared, "n": args.n,
            "prefill_gflop_ratio": prefill(plain) / prefill(shared),
            "decode_mbytes_ratio": plain["rollout decode"]["mbytes"] / shared["rollout decode"]["mbytes"]}
