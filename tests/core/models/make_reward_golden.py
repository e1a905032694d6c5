"""Regenerate the reward-model golden fixtures under tests/core/models/golden/reward_<family>/ (needs torch).

    uv pip install /path/to/torch-<cpu wheel>   # never a runtime dependency
    uv run python tests/core/models/make_reward_golden.py

For Qwen2 and Llama a tiny `*ForSequenceClassification` is built from transformers' own config
class (Qwen2Config / LlamaConfig, num_labels=1, pad_token_id=0) with seeded random weights and
saved with `save_pretrained`, beside the in-process character tokenizer (its ChatML template).
`golden.json` keeps transformers' float32 scores of
  - `ids`: a right-padded batch [4, 12] with its attention mask, one row ending in a real token
    whose id is the pad id (transformers scores the token before it), one row of one token;
  - `conversations`: chat conversations rendered with the tokenizer's chat template and scored
    one at a time, as a reward model is used (text in, score out).
Tests without torch load the saved weights with grpo_core and compare against these scores.
"""

from __future__ import annotations

import json
import os

import numpy as np

GOLDEN_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden")
_COMMON = dict(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=512, num_labels=1, pad_token_id=0)
CONFIGS = {"reward_qwen2": ("Qwen2Config", "Qwen2ForSequenceClassification", dict(_COMMON, rope_theta=10000.0)),
           "reward_llama3": ("LlamaConfig", "LlamaForSequenceClassification",
                             dict(_COMMON, rope_theta=500000.0, rms_norm_eps=1e-5))}
SEED = 21
WEIGHT_STD = 0.2  # large enough that scores are O(1) and layout mistakes show
CONVERSATIONS = [
    {"system": None, "question": "What is 2+3?", "completion": "2+3 = 5. #### 5"},
    {"system": "You are terse.", "question": "Name a prime.", "completion": "7"},
    {"system": None, "question": "Count to three.", "completion": "one, two, three, four"},
]


def golden_ids() -> tuple[np.ndarray, np.ndarray]:
    """[4, 12] right-padded with pad id 0: 12 real tokens; 7 real ending in id 0; 5 real; 1 real."""
    rng = np.random.RandomState(5)
    ids = rng.randint(4, 100, size=(4, 12)).astype(np.int32)
    mask = np.zeros_like(ids)
    for row, length in enumerate((12, 7, 5, 1)):
        mask[row, :length] = 1
        ids[row, length:] = 0
    ids[1, 6] = 0  # a real token that is the pad id (eos == pad in some models)
    return ids, mask


def conversation_messages(conv: dict) -> list[dict]:
    system = [{"role": "system", "content": conv["system"]}] if conv["system"] else []
    return system + [{"role": "user", "content": conv["question"]},
                     {"role": "assistant", "content": conv["completion"]}]


def build(name: str):
    import torch
    import transformers

    config_class, model_class, kwargs = CONFIGS[name]
    torch.manual_seed(SEED)
    model = getattr(transformers, model_class)(getattr(transformers, config_class)(**kwargs)).float().eval()
    with torch.no_grad():
        for param_name, p in model.named_parameters():
            p.normal_(0.0, WEIGHT_STD)
            if "norm" in param_name:
                p.add_(1.0)
    return model


def hf_scores(model, ids: np.ndarray, mask: np.ndarray) -> list[float]:
    import torch

    with torch.no_grad():
        out = model(input_ids=torch.tensor(ids, dtype=torch.long), attention_mask=torch.tensor(mask, dtype=torch.long))
    return out.logits[:, 0].float().tolist()


def conversation_scores(model, tokenizer) -> list[float]:
    scores = []
    for conv in CONVERSATIONS:
        text = tokenizer.apply_chat_template(conversation_messages(conv), tokenize=False)
        ids = np.asarray([tokenizer(text, add_special_tokens=False)["input_ids"]], np.int32)
        scores += hf_scores(model, ids, np.ones_like(ids))
    return scores


def write(name: str) -> None:
    import torch
    import transformers

    from grpo_core.tokenizer import build_char_tokenizer

    out = os.path.join(GOLDEN_DIR, name)
    model, tokenizer = build(name), build_char_tokenizer()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    if os.path.exists(os.path.join(out, "generation_config.json")):
        os.remove(os.path.join(out, "generation_config.json"))
    ids, mask = golden_ids()
    golden = {"input_ids": ids.tolist(), "attention_mask": mask.tolist(), "scores": hf_scores(model, ids, mask),
              "conversations": CONVERSATIONS, "conversation_scores": conversation_scores(model, tokenizer),
              "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "seed": SEED}}
    with open(os.path.join(out, "golden.json"), "w") as f:
        json.dump(golden, f, indent=1)
    print(name, golden["scores"], golden["conversation_scores"])


if __name__ == "__main__":
    for family in CONFIGS:
        write(family)
