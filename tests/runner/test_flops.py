"""`grpo-bench flops`: compiled matmul FLOPs of the update and of one decode step
against the analytic count (module doc of grpo_runner_gsm8k.commands.flops)."""

from __future__ import annotations

import json

import pytest
from grpo_core.models import QwenConfig
from grpo_core.registry import default_registry
from grpo_runner_gsm8k.commands import flops
from grpo_runner_gsm8k.costs import flops as counts

# a vocabulary large against the hidden size, as in real models: the LM head dominates
SHAPE = ["model.architecture.vocab_size=8192", "rollout.prompts_per_step=8", "rollout.n=2",
         "rollout.max_new_tokens=8", "model.architecture.max_position_embeddings=64"]


@pytest.fixture
def bench(tiny_config):
    """`bench(*overrides)`: the flops bench's figures for the tiny config at SHAPE."""
    return lambda *overrides: flops.run(tiny_config(*SHAPE, *overrides), default_registry())


def test_one_pass_update_is_within_ten_percent_of_analytic(bench):
    one_pass = bench()
    two_pass = bench("loss.options.one_pass=false")
    assert 1.0 <= one_pass["update"]["compiled_over_analytic"] <= 1.1
    # the fourth LM-head matmul of two passes shows up as waste
    assert two_pass["update"]["compiled_over_analytic"] > one_pass["update"]["compiled_over_analytic"] + 0.2
    assert one_pass["update"]["loops_without_trip_count"] == []
    assert 1.0 <= one_pass["decode_step"]["compiled_over_analytic"] <= 1.1
    json.dumps(one_pass)  # one JSON line


def test_analytic_formula_by_hand():
    q = QwenConfig(model_type="qwen2", vocab_size=100, hidden_size=8, intermediate_size=16, num_hidden_layers=2,
                   num_attention_heads=2, num_key_value_heads=1)  # head_dim 4: q = 8, kv = 4
    per_layer = 8 * 8 + 2 * 8 * 4 + 8 * 8 + 3 * 8 * 16
    assert counts.layer_params(q) == per_layer
    rows, width, completion = 3, 5, 2
    expected = 2 * 2 * per_layer * rows * width + 2 * 2 * 8 * rows * width * 6 + 2 * 8 * 100 * rows * completion
    assert counts.forward_flops(q, rows, width, completion) == expected
    assert counts.decode_step_flops(q, rows, 7) == rows * (2 * 2 * per_layer + 4 * 2 * 8 * 7 + 2 * 8 * 100)


def test_bad_command_line_is_one_line_exit_2(capsys):
    assert flops.main(["--confg", "x.yaml"]) == 2
    assert capsys.readouterr().err.startswith("grpo-bench flops: error: ")


def test_moe_layer_counts_active_experts_only():
    """A token multiplies the router and its top-k experts, not all E (the planner's FLOPs)."""
    q = QwenConfig.tiny("qwen3_moe")  # hidden 32, 4 heads of 16, 2 KV heads, 4 experts, top-2 of 16 columns
    attention = 32 * 64 + 2 * 32 * 32 + 64 * 32
    assert counts.layer_params(q) == attention + 32 * 4 + 3 * 32 * 16 * 2
