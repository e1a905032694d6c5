"""safetensors load/export without torch, against golden HF-saved checkpoints.

The golden directories were written by HF `save_pretrained` (make_golden.py) together
with HF's f32 logits on a left-padded batch. Loading them and matching those logits to
1e-4 is the HF -> ours parity check that runs in CI; the measured error is ~3e-7.
"""

import json
import os
import re
import shutil

import jax
import numpy as np
import pytest
from flax import nnx
from grpo_core.models import QwenConfig, export_pretrained, init_from_config, load_pretrained
from grpo_core.sharding import DEFAULT_RULES, param_shardings
from grpo_core.tokenizer import build_char_tokenizer, load_tokenizer
from safetensors.numpy import load_file

FAMILIES = ("qwen2_tied", "qwen2_untied", "qwen3", "llama3_tied", "llama3_untied", "gemma3", "qwen3_moe")
PARITY_ATOL = 1e-4  # issue requirement for f32; observed max diff is ~3e-7 (gemma3, 6 layers: ~8e-6)


def _golden_dir(golden, name):
    return os.path.join(golden.GOLDEN_DIR, name)


def _golden_io(golden, name):
    io = np.load(os.path.join(_golden_dir(golden, name), "io.npz"))
    return io["input_ids"], io["attention_mask"], io["logits"]


def _golden_far_logits(golden, name):
    return np.load(os.path.join(_golden_dir(golden, name), "io.npz"))["logits_far"]


def _flat_params(model):
    return {".".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


@pytest.mark.parametrize("name", FAMILIES)
def test_golden_hf_checkpoint_logits(golden, name, logits_of):
    ids, mask, hf_logits = _golden_io(golden, name)
    model = load_pretrained(_golden_dir(golden, name), dtype="float32")
    real = mask.astype(bool)
    assert np.abs(logits_of(model, ids, mask) - hf_logits)[real].max() <= PARITY_ATOL
    far = golden.positions(mask) + golden.POSITION_OFFSET
    assert np.abs(logits_of(model, ids, mask, far) - _golden_far_logits(golden, name))[real].max() <= PARITY_ATOL


# gemma3: a 3-token prefill, then 7 decode steps whose queries reach past the 4-slot window.
@pytest.mark.parametrize("name, prefill", [("llama3_tied", 6), ("llama3_untied", 6), ("gemma3", 3),
                                            ("qwen3_moe", 6)])
def test_golden_hf_logits_through_the_kv_cache(golden, name, prefill):
    """A prefill then one-token decode steps give HF's logits on every real token."""
    ids, mask, hf_logits = _golden_io(golden, name)
    model = load_pretrained(_golden_dir(golden, name), dtype="float32")
    cache = model.init_cache(ids.shape[0], ids.shape[1])
    steps = [(0, prefill)] + [(t, t + 1) for t in range(prefill, ids.shape[1])]
    logits = []
    for start, end in steps:
        hidden, cache = model(ids[:, start:end], attention_mask=mask[:, start:end], cache=cache)
        logits.append(np.asarray(model.logits(hidden)))
    real = mask.astype(bool)
    assert np.abs(np.concatenate(logits, axis=1) - hf_logits)[real].max() <= PARITY_ATOL


def test_gemma3_greedy_through_the_kv_cache_equals_hf_generate(golden):
    """Prefill then greedy one-token steps on the golden's left-padded rows give the tokens of
    transformers' `generate` (stored in the fixture), 8 tokens past 10-token rows and a 4-slot window."""
    io = np.load(os.path.join(_golden_dir(golden, "gemma3"), "io.npz"))
    model = load_pretrained(_golden_dir(golden, "gemma3"), dtype="float32")
    ids, mask, expected = io["input_ids"], io["attention_mask"], io["greedy"]
    step = nnx.jit(lambda model, ids, mask, cache: model(ids, attention_mask=mask, cache=cache))
    hidden, cache = step(model, ids, mask, model.init_cache(ids.shape[0], ids.shape[1] + expected.shape[1]))
    tokens = []
    for _ in range(expected.shape[1]):
        tokens.append(np.asarray(model.logits(hidden[:, -1:])[:, 0].argmax(-1), np.int32))
        hidden, cache = step(model, tokens[-1][:, None], np.ones((ids.shape[0], 1), np.int32), cache)
    np.testing.assert_array_equal(np.stack(tokens, axis=1), expected)


@pytest.mark.parametrize("name", FAMILIES)
def test_export_reproduces_hf_checkpoint_exactly(golden, name, tmp_path):
    """Load then export gives HF's own tensor names, layouts and values bit for bit."""
    source = _golden_dir(golden, name)
    export_pretrained(load_pretrained(source, dtype="float32"), tmp_path)
    ours, theirs = load_file(tmp_path / "model.safetensors"), load_file(os.path.join(source, "model.safetensors"))
    assert sorted(ours) == sorted(theirs)
    for key, value in theirs.items():
        np.testing.assert_array_equal(ours[key], value, err_msg=key)
    with open(tmp_path / "config.json") as f, open(os.path.join(source, "config.json")) as g:
        assert QwenConfig.from_hf_dict(json.load(f)) == QwenConfig.from_hf_dict(json.load(g))


def test_bfloat16_load_and_export_keep_dtype(golden, tmp_path):
    model = load_pretrained(_golden_dir(golden, "qwen3"), dtype="bfloat16")
    assert {str(v.dtype) for v in _flat_params(model).values()} == {"bfloat16"}
    export_pretrained(model, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert {str(v.dtype) for v in load_file(tmp_path / "model.safetensors").values()} == {"bfloat16"}


def test_load_with_mesh_places_each_tensor_on_its_sharding(golden, mesh8, logits_of):
    source = _golden_dir(golden, "qwen3")
    plain = load_pretrained(source, dtype="float32")
    sharded = load_pretrained(source, dtype="float32", mesh=mesh8, rules=DEFAULT_RULES)
    expected = {
        ".".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(param_shardings(plain, mesh8, DEFAULT_RULES))
    }
    params = _flat_params(sharded)
    assert any(len(s.device_set) == 8 and s.spec != jax.sharding.PartitionSpec(None) for s in expected.values())
    for path, value in params.items():
        assert value.sharding.is_equivalent_to(expected[path], value.ndim), path
        np.testing.assert_array_equal(np.asarray(value), np.asarray(_flat_params(plain)[path]))
    ids, mask, hf_logits = _golden_io(golden, "qwen3")
    real = mask.astype(bool)
    assert np.abs(logits_of(sharded, ids, mask) - hf_logits)[real].max() <= PARITY_ATOL


def test_sharded_index_export_round_trip(randomize, mesh8, tmp_path, left_padded, logits_of):
    model = randomize(init_from_config(QwenConfig.tiny("qwen2", tie_word_embeddings=False)), seed=7)
    (tmp_path / "model.safetensors").write_bytes(b"stale")  # must not shadow the new index
    export_pretrained(model, tmp_path, max_shard_bytes=20_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and not (tmp_path / "model.safetensors").exists()
    assert all(os.path.getsize(tmp_path / s) < 20_000 + 16_384 for s in shards)  # + one oversized tensor slack
    assert index["metadata"]["total_size"] == sum(v.nbytes for v in _flat_params(model).values())
    reloaded = load_pretrained(tmp_path, dtype="float32", mesh=mesh8)
    for path, value in _flat_params(model).items():
        np.testing.assert_array_equal(np.asarray(_flat_params(reloaded)[path]), np.asarray(value), err_msg=path)
    # Exporting the mesh-sharded model gathers each tensor back: same files.
    export_pretrained(reloaded, tmp_path / "again", max_shard_bytes=20_000)
    for shard in shards:
        again, first = load_file(tmp_path / "again" / shard), load_file(tmp_path / shard)
        assert all(np.array_equal(again[k], first[k]) for k in first)
    ids, mask = left_padded(128, 6, pads=(0, 1, 3, 5))
    # Sharded matmuls sum in another order: ~1e-7 apart on O(1) logits.
    np.testing.assert_allclose(logits_of(reloaded, ids, mask), logits_of(model, ids, mask), atol=1e-5, rtol=0)


def test_export_saves_tokenizer(tmp_path):
    model = init_from_config(QwenConfig.tiny("qwen3"))
    tokenizer = build_char_tokenizer()
    export_pretrained(model, tmp_path, tokenizer=tokenizer)
    reloaded = load_tokenizer(tmp_path)
    text = "<|im_start|>user\n1+1=?<|im_end|>\n"
    assert reloaded(text)["input_ids"] == tokenizer(text)["input_ids"]
    with pytest.raises(ValueError, match="tokenizer has 100 tokens but the model's vocab_size is 64"):
        export_pretrained(
            init_from_config(QwenConfig.tiny("qwen2", vocab_size=64)), tmp_path / "x", tokenizer=tokenizer
        )


# ---- errors name the file ---------------------------------------------------------------
@pytest.fixture
def golden_copy(golden, tmp_path):
    target = tmp_path / "ckpt"
    shutil.copytree(_golden_dir(golden, "qwen2_tied"), target)
    return target


def test_corrupt_safetensors_names_the_file(golden_copy):
    (golden_copy / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(ValueError, match=r"ckpt/model\.safetensors"):
        load_pretrained(golden_copy)


def test_truncated_safetensors_names_the_file(golden_copy):
    path = golden_copy / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-1000])
    with pytest.raises(ValueError, match=r"ckpt/model\.safetensors"):
        load_pretrained(golden_copy)


def test_missing_shard_named(tmp_path):
    export_pretrained(init_from_config(QwenConfig.tiny("qwen2")), tmp_path, max_shard_bytes=20_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    victim = sorted(set(index["weight_map"].values()))[1]
    os.remove(tmp_path / victim)
    with pytest.raises(FileNotFoundError, match=rf"{re.escape(victim)} is listed in .*model\.safetensors\.index\.json"):
        load_pretrained(tmp_path)


def test_no_weights_and_not_a_dir(tmp_path, golden_copy):
    os.remove(golden_copy / "model.safetensors")
    with pytest.raises(FileNotFoundError, match="neither model.safetensors nor model.safetensors.index.json"):
        load_pretrained(golden_copy)
    with pytest.raises(FileNotFoundError, match="not a model directory"):
        load_pretrained(str(tmp_path / "does" / "not" / "exist"))


def test_missing_and_unexpected_tensors_are_named(golden_copy):
    tensors = load_file(golden_copy / "model.safetensors")
    from safetensors.numpy import save_file

    save_file({k: v for k, v in tensors.items() if "layers.1.mlp.up_proj" not in k}, golden_copy / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing 1 tensor\(s\): model\.layers\.1\.mlp\.up_proj\.weight"):
        load_pretrained(golden_copy)
    save_file(
        {**tensors, "model.layers.0.self_attn.q_norm.weight": np.ones(8, np.float32)}, golden_copy / "model.safetensors"
    )
    with pytest.raises(ValueError, match=r"q_norm\.weight.*ckpt/model\.safetensors has no parameter in a qwen2 model"):
        load_pretrained(golden_copy)


def test_shape_mismatch_is_named(golden_copy):
    config = json.loads((golden_copy / "config.json").read_text())
    config["intermediate_size"] = 48
    (golden_copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"mlp\.\w+_proj\.weight' in .*model\.safetensors has shape"):
        load_pretrained(golden_copy)
