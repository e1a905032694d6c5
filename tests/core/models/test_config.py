import json

import pytest
from flax import nnx
from grpo_core.models import PRESETS, QwenConfig, QwenModel
from grpo_core.models.presets import preset


def _qwen25_style(**overrides):
    """A transformers-4.x style Qwen2.5 config.json (as published on the Hub)."""
    d = {
        "architectures": ["Qwen2ForCausalLM"],
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "hidden_act": "silu",
        "hidden_size": 896,
        "initializer_range": 0.02,
        "intermediate_size": 4864,
        "max_position_embeddings": 32768,
        "max_window_layers": 21,
        "model_type": "qwen2",
        "num_attention_heads": 14,
        "num_hidden_layers": 24,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "sliding_window": 32768,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.43.1",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": 151936,
    }
    d.update(overrides)
    return d


def test_hub_style_config_matches_preset():
    cfg = QwenConfig.from_hf_dict(_qwen25_style())
    assert cfg.replace(bos_token_id=None, eos_token_id=None) == PRESETS["qwen2.5-0.5b"]
    assert cfg.head_dim == 64 and cfg.attention_bias is True and cfg.eos_token_id == 151645


def test_transformers5_layout_equals_4x_layout():
    v4 = _qwen25_style()
    v5 = {k: v for k, v in v4.items() if k not in ("rope_theta", "torch_dtype")}
    v5.update(
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        dtype="bfloat16",
        layer_types=["full_attention"] * 24,
    )
    assert QwenConfig.from_hf_dict(v5) == QwenConfig.from_hf_dict(v4)


@pytest.mark.parametrize("name", ["tiny-qwen2", "tiny-qwen3", "qwen2.5-7b", "qwen3-8b"])
def test_hf_dict_round_trip(name):
    cfg = PRESETS[name]
    assert QwenConfig.from_hf_dict(json.loads(json.dumps(cfg.to_hf_dict()))) == cfg


def test_qwen3_head_dim_is_explicit():
    cfg = PRESETS["qwen3-0.6b"]
    assert cfg.head_dim * cfg.num_attention_heads != cfg.hidden_size
    assert cfg.attention_bias is False and cfg.has_qk_norm


def _param_count(cfg):
    model = nnx.eval_shape(lambda: QwenModel(cfg, rngs=nnx.Rngs(0)))
    return sum(x.size for x in __import__("jax").tree.leaves(nnx.state(model, nnx.Param)))


# Published totals: Qwen2.5-0.5B and Qwen3-0.6B (tied heads) and Llama-3.1-8B(-Instruct) by their Hub
# safetensors; Gemma 3 4B / 12B text models by keras-hub's presets (`gemma3_4b_text`, `gemma3_12b_text`).
@pytest.mark.parametrize("name, published", [
    ("qwen2.5-0.5b", 494_032_768), ("qwen3-0.6b", 596_049_920), ("llama-3.1-8b", 8_030_261_248),
    ("gemma-3-4b", 3_880_099_328), ("gemma-3-12b", 11_765_788_416)])
def test_preset_parameter_counts_match_published_sizes(name, published):
    assert _param_count(PRESETS[name]) == published


def test_qwen3_30b_a3b_preset_has_its_published_total_and_active_sizes():
    """The model card: 30.5B parameters, 3.3B activated (8 of 128 experts per token)."""
    cfg = PRESETS["qwen3-30b-a3b"]
    idle_experts = (cfg.num_experts - cfg.num_experts_per_tok) * 3 * cfg.hidden_size * cfg.moe_intermediate_size
    total = _param_count(cfg)
    assert round(total / 1e9, 1) == 30.5
    assert 3.3e9 <= total - cfg.num_hidden_layers * idle_experts < 3.4e9  # 3,353,032,704


@pytest.mark.parametrize(
    "overrides, key, value",
    [
        ({"rope_scaling": {"type": "yarn", "factor": 4.0}}, "rope_scaling.rope_type", "yarn"),
        ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e6}}, "rope_type", "dynamic"),
        ({"use_sliding_window": True}, "use_sliding_window", "True"),
        ({"hidden_act": "gelu"}, "hidden_act", "gelu"),
        ({"model_type": "gemma3"}, "model_type", "gemma3"),
        ({"attention_dropout": 0.1}, "attention_dropout", "0.1"),
        ({"quantization_config": {"quant_method": "gptq"}}, "quantization_config", "gptq"),
        ({"torch_dtype": "int8"}, "torch_dtype", "int8"),
    ],
)
def test_unsupported_options_are_named_errors(overrides, key, value):
    with pytest.raises(ValueError) as err:
        QwenConfig.from_hf_dict(_qwen25_style(**overrides))
    msg = str(err.value)
    assert key in msg and value in msg and "supported" in msg


def test_grouping_must_divide():
    with pytest.raises(ValueError, match="multiple of num_key_value_heads=3"):
        QwenConfig.tiny("qwen2", num_key_value_heads=3)


def test_missing_config_json_names_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        QwenConfig.from_pretrained_dir(tmp_path)


def test_unknown_preset_lists_available():
    with pytest.raises(ValueError, match="qwen2.5-0.5b"):
        preset("qwen9")


def _gemma3_1b_style(**overrides):
    """google/gemma-3-1b-it's config.json (transformers 4.50 layout)."""
    d = {"architectures": ["Gemma3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
         "attn_logit_softcapping": None, "bos_token_id": 2, "cache_implementation": "hybrid", "eos_token_id": [1, 106],
         "final_logit_softcapping": None, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
         "hidden_size": 1152, "initializer_range": 0.02, "intermediate_size": 6912, "max_position_embeddings": 32768,
         "model_type": "gemma3_text", "num_attention_heads": 4, "num_hidden_layers": 26, "num_key_value_heads": 1,
         "pad_token_id": 0, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000,
         "rope_scaling": None, "rope_theta": 1000000, "sliding_window": 512, "sliding_window_pattern": 6,
         "torch_dtype": "bfloat16", "transformers_version": "4.50.0.dev0", "use_cache": True, "vocab_size": 262144}
    d.update(overrides)
    return d


def test_gemma3_1b_config_reads_its_layers_and_parameter_count():
    cfg = QwenConfig.from_hf_dict(_gemma3_1b_style())
    windows = cfg.sliding_windows
    assert [i for i, w in enumerate(windows) if w == 0] == [5, 11, 17, 23] and set(windows) == {0, 512}
    assert _param_count(cfg) == 999_885_952  # Gemma 3 1B's published total (tied head)
    assert QwenConfig.from_hf_dict(json.loads(json.dumps(cfg.to_hf_dict()))) == cfg


def test_gemma3_transformers5_layout_equals_4x_layout(golden):
    """transformers 5 writes rope_parameters per layer type; 4.x keys give the same config."""
    with open(f"{golden.GOLDEN_DIR}/gemma3/config.json") as f:
        v5 = json.load(f)
    assert "full_attention" in v5["rope_parameters"]
    v4 = dict(golden.FAMILIES["gemma3"], bos_token_id=2, eos_token_id=1)  # Gemma3TextConfig's defaults
    assert QwenConfig.from_hf_dict(v5) == QwenConfig.from_hf_dict(v4)


@pytest.mark.parametrize(
    "overrides, key, value",
    [
        ({"final_logit_softcapping": 30.0}, "final_logit_softcapping", "30.0"),
        ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping", "50.0"),
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention", "True"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 8.0}}, "rope_scaling.rope_type", "yarn"),
        ({"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                              "sliding_attention": {"rope_type": "linear", "factor": 2.0}}},
         "rope_parameters.sliding_attention.rope_type", "linear"),
        ({"layer_types": ["full_attention"] * 3}, "layer_types", "26 entries"),
        ({"hidden_activation": "silu"}, "hidden_act", "silu"),
        ({"attention_bias": True}, "attention_bias", "True"),
    ],
)
def test_gemma3_unsupported_options_are_named_errors(overrides, key, value):
    with pytest.raises(ValueError) as err:
        QwenConfig.from_hf_dict(_gemma3_1b_style(**overrides))
    msg = str(err.value)
    assert key in msg and value in msg and "supported" in msg and "\n" not in msg, msg


# ---- Gemma 3 4B / 12B / 27B: the multimodal Gemma3ForConditionalGeneration config.json ----------
_GEMMA3_4B_TEXT = {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text", "num_hidden_layers": 34,
                   "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024}
_GEMMA3_27B_TEXT = {"head_dim": 128, "hidden_size": 5376, "intermediate_size": 21504, "model_type": "gemma3_text",
                    "num_attention_heads": 32, "num_hidden_layers": 62, "num_key_value_heads": 16,
                    "query_pre_attn_scalar": 168, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                    "sliding_window": 1024}


def _gemma3_multimodal_style(text=_GEMMA3_27B_TEXT, **overrides):
    """google/gemma-3-27b-it's config.json (transformers 4.50 layout: text_config keeps only the keys
    that differ from Gemma3TextConfig's defaults; the eos ids and dtype are outside it)."""
    d = {"architectures": ["Gemma3ForConditionalGeneration"], "boi_token_index": 255999, "eoi_token_index": 256000,
         "eos_token_id": [1, 106], "image_token_index": 262144, "initializer_range": 0.02, "mm_tokens_per_image": 256,
         "model_type": "gemma3", "text_config": dict(text), "torch_dtype": "bfloat16",
         "transformers_version": "4.50.0.dev0",
         "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
                           "model_type": "siglip_vision_model", "num_attention_heads": 16, "num_hidden_layers": 27,
                           "patch_size": 14, "vision_use_head": False}}
    d.update(overrides)
    return d


def test_gemma3_multimodal_config_reads_its_text_config():
    cfg = QwenConfig.from_hf_dict(_gemma3_multimodal_style())
    assert (cfg.model_type, cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers) == ("gemma3_text", 5376,
                                                                                               21504, 62)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (32, 16, 128)
    assert cfg.vocab_size == 262_208 and cfg.max_position_embeddings == 131_072  # Gemma3TextConfig's defaults
    assert cfg.family.attention_scale(cfg) == 168 ** -0.5
    assert dict(cfg.rope_scaling) == {"factor": 8.0, "rope_type": "linear"} and cfg.rope_theta == 1_000_000.0
    windows = cfg.sliding_windows
    assert [i for i, w in enumerate(windows) if w == 0] == [5, 11, 17, 23, 29, 35, 41, 47, 53, 59]
    assert set(windows) == {0, 1024}
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.torch_dtype) == (2, (1, 106), "bfloat16")
    # Written back it is the text model's own config.json (what export writes).
    assert QwenConfig.from_hf_dict(json.loads(json.dumps(cfg.to_hf_dict()))) == cfg
    assert cfg.to_hf_dict()["architectures"] == ["Gemma3ForCausalLM"]


@pytest.mark.parametrize("text", [_GEMMA3_4B_TEXT, _GEMMA3_27B_TEXT, {"model_type": "gemma3_text"}],
                         ids=["4b", "27b", "all-defaults"])
def test_gemma3_text_config_omitted_keys_are_transformers_defaults(text):
    """A text_config that omits keys reads as transformers' Gemma3TextConfig with those keys written out."""
    transformers = pytest.importorskip("transformers")
    full = transformers.Gemma3TextConfig(**{k: v for k, v in text.items() if k != "model_type"}).to_dict()
    expected = QwenConfig.from_hf_dict({**full, "eos_token_id": [1, 106], "torch_dtype": "bfloat16"})
    assert QwenConfig.from_hf_dict(_gemma3_multimodal_style(text)) == expected


def test_gemma3_multimodal_outer_token_ids_and_dtype_win():
    """transformers 5 writes text_config in full (its default eos 1 too); the outer ids are the model's."""
    text = dict(_GEMMA3_4B_TEXT, eos_token_id=1, bos_token_id=2)
    assert QwenConfig.from_hf_dict(_gemma3_multimodal_style(text)).eos_token_id == (1, 106)
    outer_lacks = {k: v for k, v in _gemma3_multimodal_style(text).items() if k not in ("eos_token_id", "torch_dtype")}
    cfg = QwenConfig.from_hf_dict({**outer_lacks, "dtype": "float32"})
    assert (cfg.eos_token_id, cfg.torch_dtype) == (1, "float32")


@pytest.mark.parametrize(
    "d, words",
    [
        (_gemma3_multimodal_style(model_type="llava", architectures=["LlavaForConditionalGeneration"]),
         ["'llava'", "multimodal", "text_config and vision_config", "gemma3 (Gemma3ForConditionalGeneration)"]),
        ({**_qwen25_style(model_type="qwen2_5_vl"), "vision_config": {"depth": 32}},
         ["'qwen2_5_vl'", "multimodal", "(vision_config)"]),
        ({k: v for k, v in _gemma3_multimodal_style().items() if k != "text_config"},
         ["text_config=None", "model_type 'gemma3'"]),
        (_gemma3_multimodal_style(dict(_GEMMA3_4B_TEXT, model_type="gemma2")), ["text_config.model_type='gemma2'"]),
        (_gemma3_multimodal_style(tie_word_embeddings=False), ["tie_word_embeddings=False"]),
    ],
    ids=["llava", "vision-only", "no-text-config", "other-text-model", "untied-outside"],
)
def test_unsupported_multimodal_configs_are_one_line_errors(d, words):
    with pytest.raises(ValueError) as err:
        QwenConfig.from_hf_dict(d)
    msg = str(err.value)
    assert all(word in msg for word in words) and "supported" in msg and "\n" not in msg, msg
