"""Collective traffic of a compiled decode: bytes per decoded token.

    compiled = decode.lower(weights, cache, state, key, **static).compile()
    decode_collective_bytes_per_token(compiled)   # {"all-reduce": 40209408, ...}
    decode_collectives_per_token(compiled)        # {"all-reduce": 72, ...}: each pays a latency

The decode is one `while_loop` whose body samples one token for every row, so the
collectives in one execution of that body are the traffic per decoded token (per
device, bytes of each collective's result). Compile for the real target (a TPU
topology through libtpu) to see what that compiler does; XLA:CPU's partitioner
may place collectives differently.
"""

from __future__ import annotations

from typing import Any

from grpo_core.hlo import HloModule


def decode_loop_body(module: HloModule) -> str | None:
    """The body of the top-level while loop that moves the most collective bytes (the decode's)."""
    bodies = [inst.body() for inst in module.while_loops() if inst.body()]
    if not bodies:
        raise ValueError("the compiled function has no top-level while loop; pass the compiled `decode`")
    return max(bodies, key=lambda body: sum(module.collective_bytes(body).values()))


def decode_collective_bytes_per_token(compiled: Any) -> dict[str, int]:
    """{collective kind: bytes} in one iteration of the decode loop of `compiled`."""
    module = HloModule(compiled.as_text())
    return module.collective_bytes(decode_loop_body(module))


def decode_collectives_per_token(compiled: Any) -> dict[str, int]:
    """{collective kind: how many} one iteration of the decode loop of `compiled` issues."""
    module = HloModule(compiled.as_text())
    return module.collective_count(decode_loop_body(module))


def decode_traffic_note(decoder: Any, gathered: bool) -> str:
    """The collectives the compiled decode loop runs for every token, per device, in words."""
    traffic, counts = decode_collective_bytes_per_token(decoder), decode_collectives_per_token(decoder)
    if not traffic:
        return "collectives per decoded token: none"
    listed = ", ".join(f"{counts.get(kind, 0)} {kind} {size / (1 << 20):.1f} MiB"
                       for kind, size in sorted(traffic.items()))
    hint = ("" if gathered else "; rollout.options.gather_weights=true gathers FSDP-sharded weights once per "
            "rollout instead (a full compute-dtype copy per device)")
    return f"collectives per decoded token: {listed}{hint}"
