"""Writes the golden fixtures of the rollout tests (needs torch + transformers).

For each family a random tiny model is created with transformers, saved in HF format
(config.json + model.safetensors) under golden/<name>/, and `generate` (greedy, KV cache
on, a left-padded batch of 48 prompts) is recorded in golden/<name>/golden.json, once without a stop
token and once with one that ends some rows early. CI then checks the `jax` backend
against these tokens without torch.

    uv run python tests/rollout/make_golden.py [family ...]
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

GOLDEN_DIR = Path(__file__).parent / "golden"
PAD_ID = 0
MAX_NEW_TOKENS = 12
ROWS = 48


def golden_prompts(rows: int = ROWS, seed: int = 3) -> list[list[int]]:
    """`rows` unpadded prompts of 1 to 10 tokens (never the pad id), so the batch is left-padded:
    four written out, the rest drawn with a fixed seed. Seed 3 keeps every family's greedy path
    clear of near-ties (top-2 logit gap >= 1e-3 in transformers, ~100x float32's disagreement;
    seed 0 has a MoE row at 2e-5, where rounding alone may flip the argmax)."""
    written = [[5, 17, 33, 2, 91], [64, 3], [7, 7, 120, 45, 12, 99, 1, 30], [88]]
    rng = np.random.default_rng(seed)
    drawn = [rng.integers(1, 128, size=rng.integers(1, 11)).tolist() for _ in range(rows - len(written))]
    return written + drawn


PROMPTS = golden_prompts()

FAMILIES = {
    # Untied Qwen2 (q/k/v bias), the benchmark's family.
    "qwen2": dict(model_type="qwen2", tie_word_embeddings=False),
    # Tied Qwen3 (q/k RMSNorm, explicit head_dim).
    "qwen3": dict(model_type="qwen3", tie_word_embeddings=True, head_dim=16),
    # Tied Llama 3 with llama3 RoPE scaling (head_dim 8: one frequency kept, one interpolated, two divided).
    "llama3": dict(model_type="llama", tie_word_embeddings=True,
                   rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    # Gemma 3 text: layer 0 slides over 4 slots (rows reach 22 tokens), layer 1 is global; untied
    # (tied, the scaled embeddings make the tiny random model repeat its last token).
    "gemma3": dict(model_type="gemma3_text", tie_word_embeddings=False, head_dim=16, sliding_window=4,
                   sliding_window_pattern=2, query_pre_attn_scalar=16, rope_local_base_freq=10000.0),
    # Untied Qwen3-MoE: 4 experts, top-2, renormalised router weights.
    "qwen3_moe": dict(model_type="qwen3_moe", tie_word_embeddings=False, head_dim=16, num_experts=4,
                      num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True),
}
ARCHITECTURE = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0, rms_norm_eps=1e-6,
                    max_position_embeddings=256, torch_dtype="float32",
                    # Wide init: logits far apart, so argmax ties can not flip between implementations.
                    initializer_range=0.3)


def left_padded(prompts):
    width = max(len(p) for p in prompts)
    ids = np.full((len(prompts), width), PAD_ID, np.int64)
    mask = np.zeros((len(prompts), width), np.int64)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = prompt
        mask[row, width - len(prompt):] = 1
    return ids, mask


def hf_greedy(model_dir: Path, prompts, eos: int | None):
    """transformers greedy generate -> (tokens [N, MAX_NEW_TOKENS] padded with PAD_ID, min top-2 logit gap)."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    ids, mask = left_padded(prompts)
    with torch.inference_mode():
        out = model.generate(torch.from_numpy(ids), attention_mask=torch.from_numpy(mask), do_sample=False,
                             max_new_tokens=MAX_NEW_TOKENS, eos_token_id=eos, pad_token_id=PAD_ID,
                             output_scores=True, return_dict_in_generate=True, top_k=None, top_p=None,
                             temperature=None, **({} if eos is not None else {"min_new_tokens": MAX_NEW_TOKENS}))
    tokens = np.full((len(prompts), MAX_NEW_TOKENS), PAD_ID, np.int64)
    new = out.sequences[:, ids.shape[1]:].numpy()
    tokens[:, :new.shape[1]] = new
    top2 = torch.stack(out.scores).topk(2, dim=-1).values  # [steps, N, 2]
    return tokens, float((top2[..., 0] - top2[..., 1]).min())


def make_model(name: str, seed: int) -> Path:
    import torch
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.AutoConfig.for_model(**ARCHITECTURE, **FAMILIES[name])
    model = transformers.AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float32)
    out = GOLDEN_DIR / name
    model.save_pretrained(out, safe_serialization=True)
    (out / "generation_config.json").unlink(missing_ok=True)
    return out


def main(names: list[str]) -> None:
    """Writes the fixtures of `names` (default: every family); a family's seed is its place in FAMILIES.
    A family's model is made once: later runs record `generate` again on the model already saved."""
    for seed, name in enumerate(FAMILIES):
        if names and name not in names:
            continue
        model_dir = GOLDEN_DIR / name
        if not (model_dir / "model.safetensors").exists():
            make_model(name, seed)
        free, gap = hf_greedy(model_dir, PROMPTS, eos=None)
        eos = int(free[0, 3])  # a token row 0 produces mid-way: it ends that row (and maybe others) early
        stopped, gap_eos = hf_greedy(model_dir, PROMPTS, eos=eos)
        record = dict(prompts=PROMPTS, pad_id=PAD_ID, max_new_tokens=MAX_NEW_TOKENS, tokens=free.tolist(),
                      eos=eos, tokens_with_eos=stopped.tolist(), min_top2_logit_gap=min(gap, gap_eos))
        (model_dir / "golden.json").write_text(json.dumps(record) + "\n")
        print(f"{name}: min top-2 logit gap {record['min_top2_logit_gap']:.4f}, eos {eos}")


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
