"""A LoRA run's base and starting adapters, read from the model section alone: a base rebuilt from
model.* is accepted by a checkpoint whose recorded fingerprint it matches and refused, naming both
bases, by another's; model.lora.init_from must hold the adapters model.lora describes, and its
arrays are loaded unchanged."""

import jax
import numpy as np
import pytest
from flax import nnx

from grpo_core.errors import UserError
from grpo_core.models import QwenConfig, lora, peft_io
from grpo_runner_gsm8k.assembly.adapters import (base_fingerprint, base_model, check_lora_fits, lora_spec, peft_adapters,
                                        saved_base)

QCFG = QwenConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, tie_word_embeddings=True)


def test_a_rebuilt_base_matches_its_fingerprint_and_another_seed_is_refused(tiny_config):
    model_cfg = tiny_config("model.lora.rank=4").model
    _, base = nnx.split(base_model(model_cfg, QCFG))
    fingerprint = base_fingerprint(model_cfg, QCFG, base)
    _, rebuilt = saved_base(model_cfg, QCFG, fingerprint, "ckpt/2")
    for ours, theirs in zip(jax.tree.leaves(rebuilt), jax.tree.leaves(base), strict=True):
        np.testing.assert_array_equal(ours, theirs)  # the same seed and dtype: bit for bit
    other = tiny_config("model.lora.rank=4", "model.seed=1").model
    with pytest.raises(UserError, match=r"checkpoint ckpt/2 holds adapters of base random init \(seed 0\) .*"
                                        r"this run's base is random init \(seed 1\)"):
        saved_base(other, QCFG, fingerprint, "ckpt/2")


def test_init_from_loads_the_adapters_model_lora_describes_and_refuses_others(tiny_config, tmp_path):
    where = tmp_path / "peft"
    lora_cfg = tiny_config("model.lora.rank=4", "model.lora.alpha=8", f"model.lora.init_from={where}").model.lora
    spec, rng = lora_spec(lora_cfg), np.random.default_rng(0)
    arrays = {target: (rng.normal(size=(QCFG.num_hidden_layers, *fan_in, 4)).astype(np.float32),
                       rng.normal(size=(QCFG.num_hidden_layers, 4, *fan_out)).astype(np.float32))
              for target, (fan_in, fan_out) in lora.layer_shapes(QCFG).items() if target in spec.targets}
    peft_io.save_peft(where, arrays, spec, None)
    loaded = peft_adapters(lora_cfg, QCFG, spec)
    assert loaded.keys() == arrays.keys()
    for target, (a, b) in arrays.items():
        np.testing.assert_array_equal(loaded[target][0], a)
        np.testing.assert_array_equal(loaded[target][1], b)
    wider = tiny_config("model.lora.rank=8", "model.lora.alpha=8", f"model.lora.init_from={where}").model.lora
    with pytest.raises(UserError, match="holds rank 4, alpha 8, .* but model.lora says rank 8, alpha 8"):
        check_lora_fits(wider, QCFG)


def test_expert_targets_of_a_moe_model_are_refused_at_config_check(tiny_config):
    moe = QwenConfig.tiny("qwen3_moe")
    check_lora_fits(tiny_config("model.lora.rank=4", "model.lora.target_modules=[q_proj,v_proj]").model.lora, moe)
    with pytest.raises(UserError, match=r"^model.lora.target_modules: LoRA target 'gate_proj' is not a dense "
                                        r"projection of a qwen3_moe model .*; target some of q_proj, k_proj"):
        check_lora_fits(tiny_config("model.lora.rank=4", "model.lora.target_modules=[gate_proj]").model.lora, moe)
