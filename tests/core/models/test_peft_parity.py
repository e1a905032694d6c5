"""PEFT adapters both ways, against transformers + peft (torch CPU); skipped without them.

Our model with adapters, exported as a PEFT directory and loaded by
`PeftModel.from_pretrained` on the exported base, gives the same logits to <= 1e-4
(float32; the issue's bound, as the HF parity tests), for Qwen2 tied/untied and Qwen3.
A directory PEFT saved, read by us and written again, holds bitwise the same tensors.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
from safetensors.numpy import load_file  # noqa: E402

from grpo_core.models import QwenConfig, export_pretrained, init_from_config, lora  # noqa: E402
from grpo_core.models import peft_io  # noqa: E402

FAMILIES = ("qwen2_tied", "qwen2_untied", "qwen3")
PARITY_ATOL = 1e-4


def _ours_with_adapters(golden, name, randomize, targets, rslora):
    cfg = QwenConfig.from_hf_dict(golden.FAMILIES[name])
    model = randomize(init_from_config(cfg), seed=golden.SEEDS[name])
    spec = lora.LoRASpec(4, 8.0, lora.resolve_targets(targets), rslora)
    return model, spec


def _randomize_adapters(model, spec, seed):
    lora.add_adapters(model, spec, jax.random.key(seed))
    rng = np.random.default_rng(seed)
    adapters = lora.split_adapters(nnx.state(model))[0]
    nnx.update(model, jax.tree.map(lambda x: jnp.asarray(rng.normal(0, 0.2, x.shape), jnp.float32), adapters))
    return lora.split_adapters(nnx.state(model))[0]


@pytest.mark.parametrize("name, targets, rslora", [("qwen2_tied", ["all-linear"], False),
                                                   ("qwen2_untied", ["q_proj", "v_proj", "down_proj"], True),
                                                   ("qwen3", ["all-linear"], True),
                                                   ("llama3_untied", ["all-linear"], False),
                                                   ("gemma3", ["q_proj", "o_proj", "up_proj"], True),
                                                   # a MoE's adapters: attention only (experts refused)
                                                   ("qwen3_moe", ["q_proj", "k_proj", "v_proj", "o_proj"], False)])
def test_our_adapters_in_peft_give_our_logits(golden, name, targets, rslora, tmp_path, randomize, logits_of):
    model, spec = _ours_with_adapters(golden, name, randomize, targets, rslora)
    export_pretrained(model, tmp_path / "base")
    adapters = _randomize_adapters(model, spec, seed=7)
    arrays = {t: tuple(np.asarray(x) for x in pair) for t, pair in lora.adapter_arrays(adapters, spec).items()}
    peft_io.save_peft(tmp_path / "adapter", arrays, spec, str(tmp_path / "base"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32,
                                                           attn_implementation="eager")
    with_adapter = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
    ids, mask = golden.golden_inputs(model.config.vocab_size, seed=4)
    ours, theirs = logits_of(model, ids, mask), golden.hf_logits(with_adapter, ids, mask)
    real = mask.astype(bool)
    assert np.abs(ours - logits_of(nnx.merge(*_base_only(model)), ids, mask))[real].max() > 0.1  # adapters matter
    assert np.abs(ours - theirs)[real].max() <= PARITY_ATOL


def _base_only(model):
    graphdef, state = nnx.split(model)
    adapters, base = lora.split_adapters(state)
    zeroed = jax.tree.map(jnp.zeros_like, adapters)
    return graphdef, nnx.merge_state(base, zeroed)


@pytest.mark.parametrize("name", FAMILIES)
def test_peft_to_ours_to_peft_is_bitwise(golden, name, tmp_path):
    config = golden.FAMILIES[name]
    hf = golden.build_hf_model(config, seed=31)
    peft_cfg = peft.LoraConfig(r=4, lora_alpha=16, target_modules="all-linear", init_lora_weights=False)
    peft.get_peft_model(hf, peft_cfg).save_pretrained(tmp_path / "theirs")  # random A and B
    spec, arrays = peft_io.load_peft(tmp_path / "theirs", QwenConfig.from_hf_dict(config))
    peft_io.save_peft(tmp_path / "ours", arrays, spec, None)
    theirs, ours = (load_file(tmp_path / d / peft_io.ADAPTER_WEIGHTS) for d in ("theirs", "ours"))
    assert sorted(theirs) == sorted(ours) and len(ours) == 2 * 7 * config["num_hidden_layers"]
    for key in theirs:
        assert theirs[key].dtype == ours[key].dtype and np.array_equal(theirs[key], ours[key]), key
    saved = json.loads((tmp_path / "ours" / peft_io.ADAPTER_CONFIG).read_text())
    assert (saved["r"], saved["lora_alpha"], sorted(saved["target_modules"])) == (4, 16.0, sorted(lora.TARGET_PATHS))


def test_adapter_of_another_shape_is_refused(golden, tmp_path):
    config = golden.FAMILIES["qwen3"]
    peft.get_peft_model(golden.build_hf_model(config, seed=3),
                        peft.LoraConfig(r=4, target_modules=["q_proj"])).save_pretrained(tmp_path)
    other = QwenConfig.from_hf_dict({**config, "hidden_size": config["hidden_size"] * 2})
    with pytest.raises(ValueError, match=r"layers\.0\.self_attn\.q_proj\.lora_A\.weight has shape"):
        peft_io.load_peft(tmp_path, other)
