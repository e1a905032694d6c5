"""LoRA in the memory plan: the trainable state of Qwen2.5-3B at r=16 is under 2% of the
full-parameter one, and a beta > 0 LoRA run holds no reference copy of the weights."""

import math

import jax
import pytest
from flax import nnx

from grpo_core.config_io import load_config
from grpo_core.models import lora
from grpo_core.models.presets import hub_architecture
from grpo_core.registry import default_registry
from grpo_runner_gsm8k.assembly.adapters import abstract_lora_model
from grpo_runner_gsm8k.plan import Capacity, build_plan_inputs, per_device_bytes, rollout_phases
from grpo_runner_gsm8k.plan.phases import decide_lora_rollout


def _count(tree) -> int:
    return sum(math.prod(x.shape) for x in jax.tree.leaves(tree))


def test_r16_adapters_and_their_adam_state_are_under_2_percent_of_full_on_3b(repo_root):
    cfg = load_config(repo_root / "configs" / "gsm8k_qwen25_3b_v6e8.yaml", ["model.lora.rank=16"])
    qcfg = hub_architecture(cfg.model.path)
    adapters, base = lora.split_adapters(nnx.state(abstract_lora_model(cfg.model, qcfg)))
    # every projection of 36 layers: r * (fan_in + fan_out) each
    per_layer = sum(16 * (math.prod(i) + math.prod(o)) for i, o in lora.layer_shapes(qcfg).values())
    assert _count(adapters) == 36 * per_layer == 29_933_568
    # float32 adapters + two float32 Adam moments, against float32 masters + two moments
    assert (12 * _count(adapters)) / (12 * _count(base)) <= 0.02
    assert 12 * _count(adapters) / (12 * _count(base)) == pytest.approx(0.0097, abs=1e-4)


@pytest.mark.parametrize("lora_rank, reference", [("null", True), ("4", False)])
def test_lora_plan_holds_no_reference_copy(lora_rank, reference, tiny_config):
    cfg = tiny_config("loss.beta=0.1", f"model.lora.rank={lora_rank}")
    inputs = build_plan_inputs(cfg, default_registry())
    assert (inputs.reference_bytes > 0) == reference
    if not reference:  # the opt state is the adapters' (two moments each, float32)
        assert per_device_bytes(inputs.opt_state) < 3 * per_device_bytes(inputs.params) + 64
        assert per_device_bytes(inputs.frozen) > per_device_bytes(inputs.params)


def test_plan_compiles_the_per_token_decode_when_the_merged_one_does_not_fit(tiny_config):
    """The plan applies the run's merge rule (run.with_lora_rollout) to its capacity and then
    compiles the decode that rule picks: the base with the adapters cast, scored alike."""
    cfg = tiny_config("loss.beta=0.1", "model.lora.rank=4")
    inputs = build_plan_inputs(cfg, default_registry())
    roomy = decide_lora_rollout(inputs, Capacity(1 << 40, "test"))
    assert roomy.run.policy.merged_rollout and roomy.forward_params is roomy.frozen
    tight = decide_lora_rollout(build_plan_inputs(cfg, default_registry()), Capacity(1 << 10, "test"))
    assert not tight.run.policy.merged_rollout
    assert per_device_bytes(tight.forward_params) > per_device_bytes(tight.frozen)  # the adapters ride along
    assert tight.masters_beside_rollout == per_device_bytes(tight.params)  # no merged copy beside the base
    decode = [p for p in rollout_phases(tight, Capacity(1 << 40, "test")) if p.name == "rollout decode"]
    assert decode and decode[0].arguments >= per_device_bytes(tight.forward_params)


def test_mfu_counts_a_frozen_base_backward_as_one_forward(tiny_config):
    """Without weight gradients a LoRA update does about 2 forwards of model work, not 3: counting
    3 put the 7B LoRA preset's projected MFU at 103%."""
    from grpo_runner_gsm8k.plan.projection import model_update_passes

    assert model_update_passes(tiny_config().model) == 3
    assert model_update_passes(tiny_config("model.lora.rank=4", "model.lora.alpha=8").model) == 2
