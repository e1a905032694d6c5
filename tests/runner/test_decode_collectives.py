"""Collective bytes per decoded token of the rollout decode compiled by the TPU compiler
(libtpu) for a v6e-8 topology with FSDP-sharded weights; skipped without libtpu."""

from __future__ import annotations

import re

import pytest
from grpo_core.registry import default_registry
from grpo_rollout.collectives import decode_collective_bytes_per_token
from grpo_runner_gsm8k import plan
from grpo_runner_gsm8k.plan.abstract import abstract_run

SHAPE = ["model.dtype=bfloat16", "rollout.prompts_per_step=4", "rollout.n=2", "rollout.max_new_tokens=8"]


@pytest.fixture
def plan_inputs(tpu_devices, tiny_config):
    """`plan_inputs(*overrides)`: the abstract run at SHAPE on the v6e-8 devices (auto mesh: fsdp over all 8)."""
    return lambda *overrides: plan.PlanInputs(abstract_run(tiny_config(*SHAPE, *overrides), default_registry(),
                                                           tpu_devices))


def decode_bytes_per_token(inputs: plan.PlanInputs) -> dict[str, int]:
    return decode_collective_bytes_per_token(plan.compile_rollout(inputs)["rollout decode"])


def test_gathered_weights_leave_no_collective_in_the_decode_loop(plan_inputs):
    sharded = decode_bytes_per_token(plan_inputs())
    assert sum(sharded.values()) > 0  # FSDP weights: collectives every token
    assert decode_bytes_per_token(plan_inputs("rollout.options.gather_weights=true")) == {}


@pytest.mark.parametrize("capacity_gib, gathered", [(32.0, True), (0.001, False)])
def test_the_plan_takes_gathered_weights_when_auto_and_they_fit(plan_inputs, capacity_gib, gathered):
    inputs = plan_inputs("rollout.options.gather_weights=auto")
    decode = plan.rollout_phases(inputs, plan.Capacity(int(capacity_gib * plan.GIB), "test"))[-1]
    assert decode.name == "rollout decode"
    if gathered:
        assert decode.note == ("gather_weights=auto: weights gathered once per rollout (the copy fits); "
                               "collectives per decoded token: none")
    else:
        assert decode.note.startswith("gather_weights=auto: sharded weights (a gathered decode needs ")
        assert "all-gather" in decode.note or "all-reduce" in decode.note


def test_model_parallel_decode_runs_four_collectives_per_layer(plan_inputs):
    """16 query heads over 8 chips, 2 KV heads replicated: per layer and token q goes to the rows'
    chips and the attention back (2 all-to-all), and o_proj's and down_proj's partial sums are
    all-reduced into the replicated residual (2 all-reduce). No all-gather: the residual stays
    replicated through the layers (carried split by rows, each all-reduce updated a row slice that
    was all-gathered again: 6 per layer), and so do the rope tables (gathered in each layer: 8)."""
    from grpo_rollout.collectives import decode_collectives_per_token

    arch = ["model.architecture.num_attention_heads=16", "model.architecture.head_dim=16",
            "rollout.options.gather_weights=model_parallel", "rollout.n=4"]
    counts = [decode_collectives_per_token(plan.compile_rollout(plan_inputs(
        *arch, f"model.architecture.num_hidden_layers={layers}"))["rollout decode"]) for layers in (2, 4)]
    per_layer = {kind: (counts[1].get(kind, 0) - counts[0].get(kind, 0)) // 2 for kind in {*counts[0], *counts[1]}}
    assert {kind: n for kind, n in per_layer.items() if n} == {"all-reduce": 2, "all-to-all": 2}


EIGHT_BIT = ("rollout.quantize=int8", "rollout.kv_cache_dtype=int8")


@pytest.mark.parametrize("eight_bit", [(), EIGHT_BIT], ids=["bf16", "int8_weights_and_cache"])
def test_head_parallel_decode_runs_two_all_reduces_per_layer(plan_inputs, eight_bit):
    """The same model with the attention where its 2 KV heads are (2 KV head groups x 4 row groups
    on 8 chips): per layer and token one all-reduce places each chip's rows of o_proj's partial
    sums and sums the head groups, and one sums down_proj's; nothing else. On int8 weights and
    cache the same (each chip's 8-bit values and scales split alike: no scale moves per token)."""
    from grpo_rollout.collectives import decode_collectives_per_token

    arch = ["model.architecture.num_attention_heads=16", "model.architecture.head_dim=16",
            "rollout.options.gather_weights=head_parallel", "rollout.n=4", *eight_bit]
    counts = [decode_collectives_per_token(plan.compile_rollout(plan_inputs(
        *arch, f"model.architecture.num_hidden_layers={layers}"))["rollout decode"]) for layers in (2, 4)]
    per_layer = {kind: (counts[1].get(kind, 0) - counts[0].get(kind, 0)) // 2 for kind in {*counts[0], *counts[1]}}
    print("head-parallel collectives per token:", counts)
    assert {kind: n for kind, n in per_layer.items() if n} == {"all-reduce": 2}


def test_head_parallel_decode_on_int8_weights_and_cache_moves_fewer_bytes_after_a_quantize_phase(plan_inputs):
    """hidden 256 (the weights dominate the bytes): the head-parallel decode on int8 weights and cache
    moves well under the bf16 decode's bytes, and `--plan` records the on-device quantization as its
    own phase, which reads each weight once (about the f32 weights' bytes, not a decode's worth per token)."""
    arch = ["rollout.options.gather_weights=head_parallel", "rollout.n=4"] + [
        f"model.architecture.{key}={value}" for key, value in (
            ("hidden_size", 256), ("intermediate_size", 512), ("num_attention_heads", 8), ("head_dim", 32),
            ("tie_word_embeddings", "false"))]

    def accessed(program):
        cost = program.cost_analysis()
        return (cost[0] if isinstance(cost, list) else cost)["bytes accessed"]

    full, eight = (plan.compile_rollout(plan_inputs(*arch, *extra)) for extra in ((), EIGHT_BIT))
    assert "rollout quantize" in eight and "rollout quantize" not in full
    full_bytes, eight_bytes = accessed(full["rollout decode"]), accessed(eight["rollout decode"])
    print(f"head-parallel decode bytes accessed: bf16 {full_bytes:.4g}, int8 {eight_bytes:.4g}; quantize phase "
          f"{accessed(eight['rollout quantize']):.4g}")
    assert eight_bytes < 0.75 * full_bytes, (eight_bytes, full_bytes)


@pytest.fixture(scope="module")
def decode_hlo_and_flops():
    """`(hlo, flops)` of the gathered decode of a 2-layer bf16 model (hidden 256, an untied head over
    128 tokens: every kernel axis whole 128-blocks) whose weights are `mode` (none | int8 | fp8 |
    fp8_block), compiled for v6e-8 (memoised per mode)."""
    compiled = {}

    def compile_mode(plan_inputs, mode):
        if mode not in compiled:
            arch = [f"model.architecture.{key}={value}" for key, value in (
                ("hidden_size", 256), ("intermediate_size", 512), ("num_attention_heads", 4), ("head_dim", 64),
                ("tie_word_embeddings", "false"), ("vocab_size", 128))]
            decode = plan.compile_rollout(plan_inputs(*arch, f"rollout.quantize={mode}",
                                                      "rollout.options.gather_weights=true"))["rollout decode"]
            cost = decode.cost_analysis()
            compiled[mode] = decode.as_text(), (cost[0] if isinstance(cost, list) else cost)["flops"]
        return compiled[mode]
    return compile_mode


# fp8_block dequantizes block by block (grpo_rollout.quantize_blocks: XLA:CPU miscompiled the batched
# per-block products), which the TPU compiler does not fuse into the matmuls: twice the arithmetic and an
# f32 copy of each layer's gate/up kernel per token. Known; this fails (strict) once it is fixed.
FP8_BLOCK_UNFUSED = pytest.mark.xfail(strict=True, reason="fp8_block's block-by-block dequantization is not fused "
                                                          "on TPU: 3.78 MFLOP against bf16's 1.91")


@pytest.mark.parametrize("mode", ["int8", "fp8", pytest.param("fp8_block", marks=FP8_BLOCK_UNFUSED)])
def test_8bit_decode_multiplies_the_8bit_weights_and_scales_the_results(plan_inputs, decode_hlo_and_flops, mode):
    """Every projection (and the untied head) of the 8-bit decode multiplies the 8-bit values,
    exact in bf16, and scales its result per output channel: the compiled decode does the bf16
    decode's arithmetic (dequantizing each weight first doubled it: a convert and a multiply per
    weight per token), and no bf16 or f32 copy of a kernel is made outside the matmuls' fusions."""
    hlo, flops = decode_hlo_and_flops(plan_inputs, mode)
    _, bf16_flops = decode_hlo_and_flops(plan_inputs, "none")
    assert flops <= 1.01 * bf16_flops, (flops, bf16_flops)
    kernels = ["256,4,64", "256,2,64", "4,64,256", "256,512", "512,256", "256,128"]  # q, k/v, o, gate/up, down, head
    eight_bit = {"int8": "s8", "fp8": "f8e4m3fn", "fp8_block": "f8e4m3fn"}[mode]
    assert f"{eight_bit}[2,256,512]" in hlo  # the stacked 8-bit gate/up kernels reach the decode
    copies = [line for line in materialized_lines(hlo) for shape in kernels
              if re.search(rf"= (bf16|f32)\[(1,)?{shape}\]", line)]
    assert not copies, copies[:3]


def materialized_lines(hlo: str) -> list[str]:
    """The instructions of `hlo` whose results are buffers: those outside fused computations (a
    fusion's own body computes in registers and vector memory)."""
    computations = re.split(r"\n(?=\S)", hlo)
    return [line for comp in computations if not comp.startswith(("%fused", "%wrapped"))
            for line in comp.splitlines()[1:]]


def test_int8_kv_cache_decode_reads_int8_and_makes_no_bf16_copy_of_the_cache(plan_inputs):
    """The gathered decode of 16 rows x 512 slots (bf16 compute, hidden 256): with
    `rollout.kv_cache_dtype: int8` the cache stays int8 outside the attention's fusions (no
    top-level bf16 value of a layer's cache shape) and the decode program moves far fewer bytes."""
    long_cache = ["rollout.prompts_per_step=8", "rollout.max_new_tokens=256", "rollout.max_prompt_length=256",
                  "model.architecture.max_position_embeddings=1024", "rollout.options.gather_weights=true"] + [
        f"model.architecture.{key}={value}" for key, value in (
            ("hidden_size", 256), ("intermediate_size", 512), ("num_attention_heads", 4), ("head_dim", 64))]

    def decode(kv_cache_dtype):
        program = plan.compile_rollout(plan_inputs(*long_cache, f"rollout.kv_cache_dtype={kv_cache_dtype}"))[
            "rollout decode"]
        cost = program.cost_analysis()
        return program.as_text(), (cost[0] if isinstance(cost, list) else cost)["bytes accessed"]

    (int8_hlo, int8_bytes), (bf16_hlo, bf16_bytes) = decode("int8"), decode("auto")
    cache_copies = [line for line in materialized_lines(int8_hlo) if re.search(r"= bf16\[2,\d+,\d+,2,64\]", line)]
    assert not cache_copies, cache_copies[:3]
    assert re.search(r"= bf16\[2,\d+,\d+,2,64\]", bf16_hlo)  # the pattern finds the bf16 cache where it is one
    assert int8_bytes < 0.75 * bf16_bytes, (int8_bytes, bf16_bytes)
