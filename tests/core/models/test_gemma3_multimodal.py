"""Gemma 3 4B+ checkpoints (multimodal `Gemma3ForConditionalGeneration`) load as their text model.

The golden `gemma3_multimodal` was written by transformers' `save_pretrained` (make_golden.py: the
"gemma3" golden's text model inside a Gemma3ForConditionalGeneration with a one-layer vision tower)
together with its text-only f32 logits on a left-padded batch. Runs without torch.
"""

import json
import os
import shutil

import numpy as np
import pytest
from flax import nnx
from grpo_core.models import QwenConfig, export_pretrained, load_pretrained
from safetensors.numpy import load_file, save_file

PARITY_ATOL = 1e-4  # the other families' f32 bound (test_hf_io.py)
NAME = "gemma3_multimodal"


def _golden_dir(golden):
    return os.path.join(golden.GOLDEN_DIR, NAME)


def _flat_params(model):
    return {".".join(map(str, p)): np.asarray(v.get_value())
            for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def _assert_same_params(a, b):
    pa, pb = _flat_params(a), _flat_params(b)
    assert sorted(pa) == sorted(pb)
    for path, value in pa.items():
        np.testing.assert_array_equal(value, pb[path], err_msg=path)


@pytest.fixture
def checkpoint_copy(golden, tmp_path):
    target = tmp_path / "ckpt"
    shutil.copytree(_golden_dir(golden), target)
    return target


def test_golden_multimodal_checkpoint_logits(golden, logits_of):
    io = np.load(os.path.join(_golden_dir(golden), "io.npz"))
    ids, mask = io["input_ids"], io["attention_mask"]
    model = load_pretrained(_golden_dir(golden), dtype="float32")
    real = mask.astype(bool)
    assert np.abs(logits_of(model, ids, mask) - io["logits"])[real].max() <= PARITY_ATOL
    far = golden.positions(mask) + golden.POSITION_OFFSET
    assert np.abs(logits_of(model, ids, mask, far) - io["logits_far"])[real].max() <= PARITY_ATOL


def test_golden_holds_vision_tensors_and_the_text_model_of_the_gemma3_golden(golden):
    """The fixture is what the loader must cope with: 4.5x names, a vision tower and a projector."""
    names = sorted(load_file(os.path.join(_golden_dir(golden), "model.safetensors")))
    assert any(n.startswith("vision_tower.") for n in names) and any(n.startswith("multi_modal_projector.") for n in names)
    assert "language_model.model.embed_tokens.weight" in names and not any(n.startswith("model.") for n in names)
    cfg = QwenConfig.from_pretrained_dir(_golden_dir(golden))
    text = QwenConfig.from_pretrained_dir(os.path.join(golden.GOLDEN_DIR, "gemma3"))
    assert cfg == text.replace(eos_token_id=(1, 95))  # the outer config's eos ids


def test_transformers5_names_load_identical_params(golden, checkpoint_copy):
    """The same tensors under transformers 5's module names (`model.language_model.*`)."""
    path = checkpoint_copy / "model.safetensors"
    tensors = load_file(path)
    save_file({golden.transformers5_name(k): v for k, v in tensors.items()}, path, metadata={"format": "pt"})
    assert "model.language_model.layers.0.self_attn.q_proj.weight" in load_file(path)
    _assert_same_params(load_pretrained(checkpoint_copy, dtype="float32"),
                        load_pretrained(_golden_dir(golden), dtype="float32"))


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda t: {**t, "language_model.model.layers.0.mlp.extra.weight": np.ones(4, np.float32)},
         r"'language_model\.model\.layers\.0\.mlp\.extra\.weight' in .* has no parameter in a gemma3_text model"),
        # A Gemma3ForCausalLM name is not one of this checkpoint's.
        (lambda t: {**t, "model.norm.weight": t.pop("language_model.model.norm.weight")},
         r"'model\.norm\.weight' in .* has no parameter"),
        (lambda t: {k: v for k, v in t.items() if k != "language_model.model.layers.5.mlp.up_proj.weight"},
         r"missing 1 tensor\(s\): language_model\.model\.layers\.5\.mlp\.up_proj\.weight"),
        # Two layouts mixed: one parameter twice.
        (lambda t: {**t, "model.language_model.norm.weight": t["language_model.model.norm.weight"]},
         r"second copy of parameter norm\.scale"),
    ],
    ids=["unknown", "text-only-name", "missing", "two-layouts"],
)
def test_only_vision_and_projector_tensors_are_skipped(checkpoint_copy, change, match):
    path = checkpoint_copy / "model.safetensors"
    save_file(change(load_file(path)), path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=match):
        load_pretrained(checkpoint_copy, dtype="float32")


def test_export_is_a_text_only_gemma3_causal_lm_read_back_identically(golden, tmp_path, logits_of):
    model = load_pretrained(_golden_dir(golden), dtype="float32")
    export_pretrained(model, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert (config["architectures"], config["model_type"], config["eos_token_id"]) == (["Gemma3ForCausalLM"],
                                                                                       "gemma3_text", [1, 95])
    ours = load_file(tmp_path / "model.safetensors")
    source = load_file(os.path.join(_golden_dir(golden), "model.safetensors"))
    assert sorted(ours) == sorted(k.removeprefix("language_model.") for k in source if k.startswith("language_model."))
    for key, value in ours.items():
        np.testing.assert_array_equal(value, source["language_model." + key], err_msg=key)
    back = load_pretrained(tmp_path, dtype="float32")
    _assert_same_params(back, model)
    assert back.config == model.config
