"""Regenerate the golden fixtures under tests/core/models/golden/ (needs torch).

    uv pip install torch==2.13.0   # CPU wheel; never a runtime dependency
    uv run python tests/core/models/make_golden.py [family ...]

For each family a tiny HF model is built from its config with seeded random weights,
saved with HF `save_pretrained` (config.json + model.safetensors), and run in f32 on a
fixed left-padded batch; `io.npz` keeps the inputs, HF's logits and (fixtures written since
Gemma 3) HF's greedy `generate` tokens. Tests without torch
load the HF-saved weights with `load_pretrained` and compare against those logits.
`gemma3_multimodal` is a `Gemma3ForConditionalGeneration` (the released Gemma 3 4B+ layout) whose
`io.npz` holds its text-only logits.

Importable without torch: the tests reuse FAMILIES, INPUTS and the helpers.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

GOLDEN_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden")

# Tiny configs covering: Qwen2 tied (Qwen2.5 <= 3B), Qwen2 untied with one KV head
# (7B-style untied head, maximal grouping), Qwen3 (q/k norm, head_dim * heads != hidden),
# Llama 3 tied and untied (no biases, llama3 RoPE scaling), Gemma 3 text (sliding-window layers),
# Qwen3-MoE (4 experts, top-2, renormalised weights, untied head as the released models).
_COMMON = {
    "vocab_size": 96,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "max_position_embeddings": 4096,
    "hidden_act": "silu",
    "torch_dtype": "float32",
    "use_sliding_window": False,
}
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 256}
FAMILIES: dict[str, dict] = {
    "qwen2_tied": dict(
        _COMMON,
        model_type="qwen2",
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    ),
    "qwen2_untied": dict(
        _COMMON,
        model_type="qwen2",
        num_attention_heads=4,
        num_key_value_heads=1,
        rope_theta=1000000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    ),
    "qwen3": dict(
        _COMMON,
        model_type="qwen3",
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        attention_bias=False,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    ),
    # Llama 3.x with llama3 RoPE scaling: head_dim 8 and theta 5e5 give one frequency kept, one
    # interpolated and two divided by `factor` (wavelengths 6, 167, 4443, 1.2e5 against 64 and 256).
    "llama3_tied": dict(_COMMON, model_type="llama", num_attention_heads=4, num_key_value_heads=2,
                        rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
                        rope_scaling=LLAMA3_SCALING),
    "llama3_untied": dict(_COMMON, model_type="llama", num_attention_heads=4, num_key_value_heads=1,
                          rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
                          rope_scaling=LLAMA3_SCALING),
    # Gemma 3 text: 6 layers at the released 5:1 pattern (5 sliding, the 6th global), a window of 4
    # slots (shorter than the 10-token rows), linear RoPE scaling on the global layer as in 4B+,
    # query_pre_attn_scalar != head_dim and head_dim * heads != hidden.
    "gemma3": dict(model_type="gemma3_text", vocab_size=96, hidden_size=32, intermediate_size=64,
                   num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                   max_position_embeddings=4096, hidden_activation="gelu_pytorch_tanh", torch_dtype="float32",
                   sliding_window=4, sliding_window_pattern=6, query_pre_attn_scalar=24, rope_theta=1000000.0,
                   rope_local_base_freq=10000.0, rope_scaling={"rope_type": "linear", "factor": 8.0},
                   rms_norm_eps=1e-6, tie_word_embeddings=True),
    "qwen3_moe": dict(_COMMON, model_type="qwen3_moe", num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      attention_bias=False, rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
                      num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True),
}
# Gemma 3 4B+ as released: the "gemma3" text model as the language model of a
# Gemma3ForConditionalGeneration, next to a one-layer SigLIP vision tower (2x2 patches of 14 pixels,
# one image token per patch); the outer eos ids differ from text_config's as gemma-3-4b-it's [1, 106].
MULTIMODAL: dict[str, dict] = {
    "gemma3_multimodal": dict(
        model_type="gemma3",
        text_config={k: v for k, v in FAMILIES["gemma3"].items() if k != "torch_dtype"},
        vision_config=dict(model_type="siglip_vision_model", hidden_size=16, intermediate_size=32,
                           num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14,
                           vision_use_head=False),
        mm_tokens_per_image=4, eos_token_id=[1, 95], torch_dtype="float32"),
}
SEEDS = {"qwen2_tied": 11, "qwen2_untied": 12, "qwen3": 13, "llama3_tied": 14, "llama3_untied": 15, "gemma3": 16,
         "qwen3_moe": 16, "gemma3_multimodal": 17}
GREEDY_NEW_TOKENS = 8
WEIGHT_STD = 0.2  # large enough that logits are O(1) and layout mistakes show
# Families whose norms scale by (1 + weight): their weights are drawn around 0, so every norm
# scales by about 1 as in the others (drawn around 1, each of the four norms per layer doubled the
# scale and float32 noise grew with it).
NORM_SCALE_ADDS_ONE = ("gemma3_text",)


def golden_inputs(vocab_size: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """A left-padded batch [3, 10]: no padding, 3 pads, 6 pads (pad id 0)."""
    rng = np.random.RandomState(seed)
    ids = rng.randint(1, vocab_size, size=(3, 10)).astype(np.int32)
    mask = np.ones_like(ids)
    for row, pads in ((1, 3), (2, 6)):
        mask[row, :pads] = 0
        ids[row, :pads] = 0
    return ids, mask


def positions(mask: np.ndarray) -> np.ndarray:
    return np.maximum(np.cumsum(mask, axis=1) - 1, 0)


def build_hf_model(config: dict, seed: int):
    """An HF CausalLM from `config` with every parameter redrawn (norm scales around 1)."""
    adds_one = config["model_type"] in NORM_SCALE_ADDS_ONE
    return _redrawn("AutoModelForCausalLM", config, seed, lambda name: "norm" in name and not adds_one)


def build_hf_multimodal(config: dict, seed: int):
    """An HF Gemma3ForConditionalGeneration from `config`, every parameter redrawn: the language
    model's norms around 0 (they scale by 1 + weight), the vision tower's around 1."""
    return _redrawn("AutoModelForImageTextToText", config, seed,
                    lambda name: "norm" in name and "language_model" not in name)


def _redrawn(auto_class: str, config: dict, seed: int, around_one):
    """transformers' `auto_class` model of `config`, f32, every parameter drawn from N(0, WEIGHT_STD)
    in order, plus 1 where `around_one(name)` (norm scales)."""
    import torch
    import transformers

    torch.manual_seed(seed)
    hf_config = transformers.AutoConfig.for_model(**config)
    model = getattr(transformers, auto_class).from_config(hf_config, attn_implementation="eager")
    model = model.float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0.0, WEIGHT_STD)
            if around_one(name):
                p.add_(1.0)
    return model


# transformers' save_pretrained writes a Gemma3ForConditionalGeneration's tensors under the
# 4.50-4.5x names; these are its 5.x module names (save_pretrained(save_original_format=False)).
TRANSFORMERS5_PREFIXES = (("language_model.model.", "model.language_model."), ("language_model.lm_head.", "lm_head."),
                          ("vision_tower.", "model.vision_tower."),
                          ("multi_modal_projector.", "model.multi_modal_projector."))


def transformers5_name(name: str) -> str:
    """The 5.x module name of a tensor saved under a 4.5x Gemma3ForConditionalGeneration name."""
    for old, new in TRANSFORMERS5_PREFIXES:
        if name.startswith(old):
            return new + name.removeprefix(old)
    raise KeyError(f"{name!r} is no Gemma3ForConditionalGeneration tensor name")


# Far positions exercise RoPE tables where f32 angle rounding matters.
POSITION_OFFSET = 3000


def hf_logits(model, ids: np.ndarray, mask: np.ndarray, position_offset: int = 0) -> np.ndarray:
    """Logits with positions from the mask (HF's plain forward would count pads)."""
    import torch

    with torch.no_grad():
        out = model(
            input_ids=torch.tensor(ids, dtype=torch.long),
            attention_mask=torch.tensor(mask, dtype=torch.long),
            position_ids=torch.tensor(positions(mask) + position_offset, dtype=torch.long),
        )
    return out.logits.float().numpy()


def hf_greedy(model, ids: np.ndarray, mask: np.ndarray, new_tokens: int = GREEDY_NEW_TOKENS) -> np.ndarray:
    """transformers `generate` (greedy, KV cache, no stop token) on the left-padded rows -> [B, new_tokens]."""
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor(ids, dtype=torch.long), attention_mask=torch.tensor(mask, dtype=torch.long),
                             do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0,
                             eos_token_id=None, top_k=None, top_p=None, temperature=None)
    return out[:, ids.shape[1]:].numpy().astype(np.int32)


def hf_router_stats(model, ids: np.ndarray, mask: np.ndarray) -> dict[str, np.ndarray]:
    """A MoE model's balancing loss (HF's `aux_loss`, padding masked) and per-layer expert load
    [L, E] (share of the real tokens' top-k assignments, from HF's router logits)."""
    import torch

    with torch.no_grad():
        out = model(input_ids=torch.tensor(ids, dtype=torch.long), attention_mask=torch.tensor(mask, dtype=torch.long),
                    position_ids=torch.tensor(positions(mask), dtype=torch.long), output_router_logits=True)
    real = torch.tensor(mask.reshape(-1), dtype=torch.float32)
    loads = []
    for logits in out.router_logits:
        chosen = torch.topk(torch.softmax(logits.float(), -1), model.config.num_experts_per_tok, -1).indices
        counts = torch.zeros(logits.shape[-1]).scatter_add_(0, chosen.reshape(-1),
                                                            real.repeat_interleave(chosen.shape[-1]))
        loads.append((counts / counts.sum()).numpy())
    return {"aux_loss": np.float32(out.aux_loss.item()), "router_load": np.stack(loads)}


def write_family(name: str) -> None:
    import torch
    import transformers

    out = os.path.join(GOLDEN_DIR, name)
    model = build_hf_model(FAMILIES[name], SEEDS[name])
    model.save_pretrained(out)
    for extra in ("generation_config.json",):
        if os.path.exists(os.path.join(out, extra)):
            os.remove(os.path.join(out, extra))
    ids, mask = golden_inputs(FAMILIES[name]["vocab_size"])
    np.savez_compressed(
        os.path.join(out, "io.npz"),
        input_ids=ids,
        attention_mask=mask,
        logits=hf_logits(model, ids, mask),
        logits_far=hf_logits(model, ids, mask, POSITION_OFFSET),  # positions + POSITION_OFFSET
        greedy=hf_greedy(model, ids, mask),
        **(hf_router_stats(model, ids, mask) if FAMILIES[name].get("num_experts") else {}),
    )
    meta = {"torch": torch.__version__, "transformers": transformers.__version__, "seed": SEEDS[name]}
    with open(os.path.join(out, "versions.json"), "w") as f:
        json.dump(meta, f, indent=2)


def write_multimodal(name: str) -> None:
    import torch
    import transformers

    out = os.path.join(GOLDEN_DIR, name)
    model = build_hf_multimodal(MULTIMODAL[name], SEEDS[name])
    model.save_pretrained(out)
    os.remove(os.path.join(out, "generation_config.json"))
    ids, mask = golden_inputs(MULTIMODAL[name]["text_config"]["vocab_size"])
    np.savez_compressed(os.path.join(out, "io.npz"), input_ids=ids, attention_mask=mask,
                        logits=hf_logits(model, ids, mask), logits_far=hf_logits(model, ids, mask, POSITION_OFFSET))
    meta = {"torch": torch.__version__, "transformers": transformers.__version__, "seed": SEEDS[name]}
    with open(os.path.join(out, "versions.json"), "w") as f:
        json.dump(meta, f, indent=2)


def main(names: list[str]) -> int:
    """Writes the fixtures of `names` (default: every family and multimodal model)."""
    for name in names or [*FAMILIES, *MULTIMODAL]:
        (write_multimodal if name in MULTIMODAL else write_family)(name)
        print(f"wrote {os.path.join(GOLDEN_DIR, name)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
