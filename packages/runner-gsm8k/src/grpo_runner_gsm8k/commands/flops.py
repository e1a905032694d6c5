"""`grpo-bench flops --config X.yaml [key=value ...]`: FLOPs of the policy update and of
one decode step, as compiled next to the analytic count, so waste is a number.

Prints ONE JSON line. Both functions are the run's own (the plan's abstract compile:
no weights, no data). "compiled" is the matmul FLOPs of the compiled HLO with every
loop body multiplied by its trip count (`grpo_core.hlo`); XLA's `cost_analysis()`
figure is printed beside it but counts each loop body once. Figures are XLA:CPU's
unless the backend says otherwise.

Analytic count (matmuls only; q = heads * head_dim, kv = kv_heads * head_dim):
    P_layer       = H*q + 2*H*kv + q*H + 3*H*I            (q, k, v, o, gate, up, down)
    forward(N, T, C) = 2*L*P_layer*N*T                     decoder layers, all T columns
                     + 2*L*q*N*T*(T+1)                     QK^T and PV over the causal pairs
                     + 2*H*V*N*C                           LM head, completion columns only
    update        = 3 * forward(rows, prompt + completion width, completion width)
                                                           (backward = 2 x forward)
    decode step   = 2*L*P_layer*N + 4*L*q*N*S + 2*H*V*N    (S = cache slots attended)
"""

from __future__ import annotations

import json
import sys
from typing import Any

import jax

from grpo_core.hlo import HloModule
from grpo_runner_gsm8k.costs.flops import decode_step_flops, forward_flops


def figures(compiled: Any, analytic: float, devices: int, body: bool) -> dict:
    """Compiled (the per-device SPMD module times `devices`: replicated work counts
    as waste) vs analytic FLOPs; `body`: one iteration of the main while loop."""
    module = HloModule(compiled.as_text())
    computation = None
    if body:
        loops = module.while_loops()
        computation = max((w.body() for w in loops), key=module.matmul_flops)
    flops = module.matmul_flops(computation) * devices
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return {"compiled_matmul_flops": flops, "analytic_flops": analytic, "compiled_over_analytic": round(flops / analytic, 4),
            "xla_cost_analysis_flops_per_device": None if not cost else cost.get("flops"),
            "loops_without_trip_count": module.unknown_trip_counts}


def run(cfg, registry) -> dict:
    from grpo_runner_gsm8k.assembly.build import rows_per_step
    from grpo_runner_gsm8k.plan import build_plan_inputs, compile_rollout, compile_update, prompt_bucket, train_widths

    inputs = build_plan_inputs(cfg, registry)
    rows, (prompt_w, completion_w) = rows_per_step(cfg.rollout), train_widths(inputs)
    devices = inputs.run.mesh.size
    analytic = 3 * forward_flops(inputs.run.qcfg, rows, prompt_w + completion_w, completion_w)
    update = figures(compile_update(inputs), analytic, devices, body=False)
    slots = prompt_bucket(inputs) + cfg.rollout.max_new_tokens - 1
    decode = figures(compile_rollout(inputs)["rollout decode"], decode_step_flops(inputs.run.qcfg, rows, slots),
                     devices, body=True)
    return {"bench": "flops", "backend": jax.default_backend(), "devices": devices, "loss_impl": cfg.loss.impl,
            "loss_options": dict(cfg.loss.options), "rows": rows, "prompt_width": prompt_w,
            "completion_width": completion_w, "cache_slots": slots, "update": update, "decode_step": decode}


def main(argv: list[str] | None = None) -> int:
    from grpo_core.config_io import load_config
    from grpo_core.errors import UserError
    from grpo_core.registry import default_registry

    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) < 2 or args[0] != "--config":
        print("grpo-bench flops: error: usage: grpo-bench flops --config X.yaml [key=value ...]", file=sys.stderr)
        return 2
    try:
        registry = default_registry()
        print(json.dumps(run(load_config(args[1], args[2:], registry=registry), registry)), flush=True)
    except UserError as exc:
        print(f"grpo-bench flops: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
