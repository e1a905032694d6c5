"""`grpo-bench gpu` (grpo_runner_gsm8k.commands.gpu_acceptance): on CPU it runs the shrunken shapes, reports
the GPU-only parts as skipped and prints exactly one JSON line; its full shapes are the 0.5B
one-GPU preset's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from grpo_core.config_io import read_yaml
from grpo_core.testing import cpu_test_xla_flags
from grpo_core.models.presets import PRESETS
from grpo_runner_gsm8k.commands.gpu_acceptance import PHASES, SHAPES
from grpo_rollout.bench import QUANTIZED_SIDES
from grpo_runner_gsm8k.commands.gpu_parts import fp8_missing

REPO = Path(__file__).resolve().parents[2]


def test_full_shapes_are_the_one_gpu_preset():
    preset = read_yaml(REPO / "configs" / "gsm8k_qwen25_0p5b_1gpu.yaml")
    full = SHAPES["full"]
    rollout, train = preset["rollout"], preset["train"]
    assert (full.prompts, full.n, full.prompt_tokens, full.new_tokens) == (
        rollout["prompts_per_step"], rollout["n"], rollout["max_prompt_length"], rollout["max_new_tokens"])
    assert full.micro_batch == train["micro_batch_size_per_device"]
    model = PRESETS["qwen2.5-0.5b"]
    assert {k: getattr(model, k) for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                           "num_attention_heads", "num_key_value_heads", "vocab_size")} == {
        k: full.architecture[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                          "num_attention_heads", "num_key_value_heads", "vocab_size")}
    assert full.loss == (1, 4096, 151643, model.hidden_size) and full.decode_new_tokens == 512


@pytest.mark.parametrize("capability, skipped", [("8.0", True), ("8.6", True), ("8.9", False), ("9.0", False)])
def test_fp8_is_skipped_in_one_line_on_a_gpu_without_it(capability, skipped):
    device = SimpleNamespace(compute_capability=capability, device_kind="NVIDIA test card")
    reason = fp8_missing(device, gpu=True)
    assert (reason is not None) == skipped
    if skipped:
        assert reason == (f"fp8 needs an NVIDIA GPU of compute capability 8.9 or newer (L4, H100, H200); "
                          f"NVIDIA test card has {capability}")
    assert fp8_missing(SimpleNamespace(device_kind="cpu"), gpu=False) is None


@pytest.mark.slow
def test_cpu_run_prints_one_json_line_with_gpu_parts_skipped():
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": cpu_test_xla_flags(1)}
    done = subprocess.run([sys.executable, "-m", "grpo_runner_gsm8k.commands.gpu_acceptance"], capture_output=True, text=True,
                          env=env, cwd=REPO, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    [line] = done.stdout.strip().splitlines()
    record = json.loads(line)
    assert (record["bench"], record["backend"], record["shapes"]) == ("gpu", "cpu", "small")
    assert "XLA:CPU" in record["note"]
    train = record["train"]
    assert train["status"] == "ok" and len(train["steps"]) == 3
    assert all(set(step) == set(PHASES) and step["step_s"] >= step["rollout_s"] for step in train["steps"])
    assert train["peak_memory_gib"] is None  # CPU devices report no memory statistics
    decode = record["decode"]
    assert decode["status"] == "ok" and decode["rows"] == 64 and decode["tokens_per_s"] > 0
    quantize = record["quantize"]  # XLA:CPU runs the fp8 sides too: the path, not a speed
    assert quantize["status"] == "ok" and quantize["full_precision"]["tokens_per_s"] > 0
    assert all(quantize[side]["status"] == "ok" and quantize[side]["decode_speedup"] > 0 for side in QUANTIZED_SIDES)
    loss = record["loss"]
    assert [loss[impl]["status"] for impl in ("jax", "fused", "pallas")] == ["ok", "ok", "skipped"]
    assert loss["fused"]["max_abs_diff_vs_jax"]["loss"] < 1e-2
    attention = record["attention"]
    assert attention["chunked"]["status"] == "ok" and attention["chunked"]["fwd_ms"] > 0
    assert attention["cudnn"]["status"] == "skipped" and "max_abs_diff" not in attention
