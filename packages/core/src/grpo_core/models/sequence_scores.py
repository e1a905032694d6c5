"""Sequence classification with one label: a reward model's scalar score per sequence.

An HF `*ForSequenceClassification` checkpoint is a decoder of a supported family (its tensors
named as a causal LM's, without `lm_head.weight`) plus a bias-free head `score.weight`
[num_labels, hidden]. Its score is the head applied to the final (normed) hidden state of one
token per row, chosen as transformers chooses it (`GenericForSequenceClassification` in
transformers 5.x): the rightmost token whose id is not the config's `pad_token_id`, which finds
the end of a left- or right-padded row alike (a row of pad ids only takes index 0). HF refuses a
batch of several rows without a `pad_token_id`; here each row then takes its last real token,
which is what HF gives that row alone.

    head = ScoreHead.read(model_dir)                       # checks; num_labels must be 1
    index = last_scored_token(ids, mask, head.pad_token_id)   # [B] on the host
    scores = sequence_scores(model, head_weight, ids, mask, index)   # [B] float32
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from grpo_core.models.config import QwenConfig, read_config_json
from grpo_core.models.hf_io import checkpoint_tensor_files, open_safetensors

SCORE_HEAD = "score.weight"


def num_labels(hf_config: dict) -> int:
    """transformers' rule: the size of `id2label` when it is there, else `num_labels`, else 2."""
    if hf_config.get("id2label"):
        return len(hf_config["id2label"])
    return int(hf_config.get("num_labels") or 2)


@dataclass(frozen=True)
class ScoreHead:
    """What a reward model's directory says about its scoring: the decoder's architecture (built
    without an LM head), the pad id that marks a row's end, and where `score.weight` is stored."""

    decoder: QwenConfig
    pad_token_id: Optional[int]
    file: str

    @classmethod
    def read(cls, model_dir: str) -> "ScoreHead":
        """ValueError naming what is wrong: an unknown family, num_labels != 1, no score head, or a
        head of the wrong shape."""
        hf_config = read_config_json(model_dir)
        decoder = QwenConfig.from_hf_dict(hf_config).replace(tie_word_embeddings=True)  # no lm_head to load
        file = checkpoint_tensor_files(model_dir).get(SCORE_HEAD)
        if file is None:
            raise ValueError(f"{model_dir} has no {SCORE_HEAD} tensor (architectures "
                             f"{hf_config.get('architectures')}); a reward model is an HF *ForSequenceClassification "
                             "checkpoint with a score head, not a causal LM")
        labels = num_labels(hf_config)
        if labels != 1:
            raise ValueError(f"num_labels is {labels} (id2label {hf_config.get('id2label')}); a reward model "
                             "scores with one label (a scalar head score.weight [1, hidden])")
        head = cls(decoder, hf_config.get("pad_token_id"), file)
        head.check_shape()
        return head

    def check_shape(self) -> None:
        with open_safetensors(self.file) as f:
            shape = tuple(f.get_slice(SCORE_HEAD).get_shape())
        if shape != (1, self.decoder.hidden_size):
            raise ValueError(f"{SCORE_HEAD} in {self.file} has shape {list(shape)}, not "
                             f"[1, {self.decoder.hidden_size}] (one label over hidden_size)")

    def weight(self, dtype: Any) -> np.ndarray:
        """The head as a vector [H] in `dtype` (host)."""
        with open_safetensors(self.file) as f:
            return f.get_tensor(SCORE_HEAD).reshape(-1).astype(dtype)




def last_scored_token(input_ids: np.ndarray, attention_mask: np.ndarray, pad_token_id: Optional[int]) -> np.ndarray:
    """[B] int32: per row the rightmost position whose id is not `pad_token_id` (0 when every id is);
    without a pad id, the rightmost real position of `attention_mask`."""
    keep = attention_mask != 0 if pad_token_id is None else input_ids != pad_token_id  # [B, T]
    positions = np.arange(input_ids.shape[1], dtype=np.int32)[None, :]
    return (positions * keep).max(axis=1).astype(np.int32)


def sequence_scores(model: Any, head: jax.Array, input_ids: jax.Array, attention_mask: jax.Array,
                    index: jax.Array) -> jax.Array:
    """[B] float32 scores: `head` [H] on the final hidden state at `index` [B] of each row."""
    hidden = model(input_ids, attention_mask=attention_mask)  # [B, T, H]
    picked = jnp.take_along_axis(hidden, index[:, None, None].astype(jnp.int32), axis=1)[:, 0]  # [B, H]
    return jnp.einsum("bh,h->b", picked, head.astype(picked.dtype), preferred_element_type=jnp.float32)
